"""The engine's stages after "prepare", each callable on its own (an overlap schedule interleaves them).

Forward:  dispatch -> compute -> return_outputs -> gather_outputs
Backward: dispatch_backward -> compute_backward -> return_grads -> gather_grads

Communication stages start their all-to-all-v on the group they are given and return it in flight
(``async_op=True``) or done; ``wait()`` completes it; None when the plan moves nothing. No stage records
anything for autograd: the operator in :mod:`hf_distca.engine.op` chains them.
With a KV relay (``DispatchIndex.relay``, :mod:`hf_distca.planning.relay`) the stages that carry KV rows
run two all-to-all-v one after the other (a :class:`~hf_distca.comm.Chain`): dispatches send KV across
nodes to the relays first, then the relays forward it inside their node; the gradients' return sends
dk/dv to the relays inside the node first, where they are summed, then across nodes with dq. Both
stages' bytes count under the phase's name.

Buffers: a rank sends, per destination rank in rank order, the rows of each stream back to back
(dispatch: [q | k | v]; dispatch_backward: [q | out | dout | k | v]; return_grads: [dq | dk | dv]): what
the traffic ledger (:mod:`hf_distca.planning.traffic`) says each phase carries; a change here changes
its ``CARRIES`` too (tests/test_traffic.py ties the two).
A server's pools are ``cat([its own rows, rows received from rank 0, from rank 1, ...])`` per stream
(with the relay, the KV pools then hold the rows forwarded by each relay of the node, in rank order);
the kernel reads them through the plan's kernel indices (a KV prefix shared by two tasks is read twice,
so its gradients are summed with index_add).

What each stage keeps: nothing. Pools and their kernel-order copies are temporaries freed when the stage
returns; the operator keeps, per layer, the owner's q, k, v and output and the server's log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hf_distca import metrics
from hf_distca.comm import Chain, Exchange, all_to_all_v, chain
from hf_distca.engine.prepare import PreparedAttention
from hf_distca.engine.state import engine_state
from hf_distca.kernels import (
    ForwardTensors,
    VarlenOffsets,
    attention_backward,
    attention_forward,
    sinks_backward,
)
from hf_distca.planning.traffic import PHASES

FWD_DISPATCH, FWD_RETURN, BWD_DISPATCH, BWD_RETURN = PHASES


def stage_range(name: str) -> torch.profiler.record_function:
    """A profiler range ``distca.<name>`` around one stage (a few microseconds when nothing profiles)."""
    return torch.profiler.record_function("distca." + name)


@dataclass(frozen=True)
class Kernel:
    """How one layer's attention kernels run, forward and backward: the softmax ``scale`` (None:
    head_dim ** -0.5), the kernel ``backend`` and the logit ``softcap`` (None: none)."""

    scale: float | None
    backend: str
    softcap: float | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        offsets: VarlenOffsets,
        window: int | None,
        sinks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) of :func:`hf_distca.kernels.attention_forward` over ``offsets`` (``sinks``: applied)."""
        return attention_forward(
            q,
            k,
            v,
            *offsets,
            scale=self.scale,
            backend=self.backend,
            window=window,
            softcap=self.softcap,
            sinks=sinks,
        )

    def backward(
        self,
        fwd: ForwardTensors,
        dout: torch.Tensor,
        offsets: VarlenOffsets,
        window: int | None,
        sinks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """dq, dk, dv of :func:`hf_distca.kernels.attention_backward` over ``offsets`` and, with ``sinks``,
        the gradient of the sinks from these rows (:func:`hf_distca.kernels.sinks_backward`), else None."""
        grads = attention_backward(
            dout, *fwd, *offsets, scale=self.scale, backend=self.backend, window=window, softcap=self.softcap
        )
        return *grads, (None if sinks is None else sinks_backward(dout, fwd.out, fwd.lse, sinks))


Stream = tuple[torch.Tensor, list[int]]  # rows (N, H, D) grouped by destination, rows per destination


def _start(
    phase: str, streams: list[Stream], recv_counts: list[list[int]], group: Any, async_op: bool
) -> Exchange:
    """Pack ``streams`` per destination and start the all-to-all-v of ``phase`` (a name of the traffic
    ledger, its bytes counted under it); ``recv_counts[s][r]``: rows of stream s that rank r sends here."""
    world = len(streams[0][1])
    chunks = [rows.split(counts) for rows, counts in streams]
    row_elems = [rows.shape[1] * rows.shape[2] for rows, _ in streams]
    parts = [chunks[s][r].reshape(-1) for r in range(world) for s in range(len(streams))]
    send_splits = [sum(streams[s][1][r] * row_elems[s] for s in range(len(streams))) for r in range(world)]
    recv_splits = [sum(recv_counts[s][r] * row_elems[s] for s in range(len(streams))) for r in range(world)]
    return all_to_all_v(torch.cat(parts), send_splits, recv_splits, group, async_op=async_op, phase=phase)


def _unpack(
    buf: torch.Tensor, recv_counts: list[list[int]], row_shapes: list[tuple[int, int]]
) -> list[list[torch.Tensor]]:
    """Split a received buffer into, per stream, one (n, H, D) view per source rank."""
    world = len(recv_counts[0])
    sizes = [recv_counts[s][r] * h * d for r in range(world) for s, (h, d) in enumerate(row_shapes)]
    pieces = buf.split(sizes)
    out: list[list[torch.Tensor]] = [[] for _ in row_shapes]
    for r in range(world):
        for s, (h, d) in enumerate(row_shapes):
            out[s].append(pieces[r * len(row_shapes) + s].view(recv_counts[s][r], h, d))
    return out


def _pools(
    local: list[torch.Tensor], received: list[torch.Tensor] | None, recv_counts: list[list[list[int]]]
) -> list[torch.Tensor]:
    """Per stream, cat([local rows, rows from rank 0, from rank 1, ...] of every stage); ``received``: the
    stages' buffers, ``recv_counts[stage][s][r]`` rows of stream s from rank r (the local tensors themselves
    when nothing was received)."""
    if received is None:
        return local
    shapes = [(t.shape[1], t.shape[2]) for t in local]
    stages = [_unpack(buf, counts, shapes) for buf, counts in zip(received, recv_counts, strict=True)]
    return [torch.cat([t, *[p for stage in stages for p in stage[s]]]) for s, t in enumerate(local)]


def _kernel_rows(
    local: list[torch.Tensor],
    received: list[torch.Tensor] | None,
    recv_counts: list[list[list[int]]],
    indices: list[torch.Tensor],
) -> list[torch.Tensor]:
    """Per stream, the kernel's rows (pool rows at ``indices``); the pools are freed on return."""
    pools = _pools(local, received, recv_counts)
    return [pool.index_select(0, index) for pool, index in zip(pools, indices, strict=True)]


def _received_counts(prep: PreparedAttention, q_streams: int) -> list[list[list[int]]]:
    """Per stage of a dispatch, rows each rank sends here of its ``q_streams`` query-sized streams, then of
    k and v: one stage, or with the relay a second one that forwards only KV rows."""
    ix = prep.index
    stages = [[ix.recv_q_counts] * q_streams + [ix.recv_kv_counts] * 2]
    if ix.relay is not None:
        stages.append([[0] * ix.world_size] * q_streams + [ix.relay.recv_counts] * 2)
    return stages


def _relay_forward(prep: PreparedAttention, phase: str, q_streams: int, group: Any, async_op: bool):
    """The relay's second stage of a dispatch, from the first stage's received buffer: each server of this
    node gets the k and v rows it reads among those that crossed nodes to this rank (None: no relay)."""
    relay = prep.index.relay
    if relay is None:
        return None
    shapes = [(prep.q_heads, prep.head_dim)] * q_streams + [(prep.kv_heads, prep.head_dim)] * 2

    def forward(received: torch.Tensor) -> Exchange:
        *_, k_parts, v_parts = _unpack(received, _received_counts(prep, q_streams)[0], shapes)
        rows = prep.device_index(received.device).relay_send_rows
        streams = [
            (torch.cat(k_parts).index_select(0, rows), relay.send_counts),  # (N2, Hkv, D)
            (torch.cat(v_parts).index_select(0, rows), relay.send_counts),
        ]
        return _start(phase, streams, [relay.recv_counts] * 2, group, async_op)

    return forward


def _side_stream(device: torch.device) -> Any:
    """The stream a chained exchange's later stage starts on (the engine state's, per CUDA device); None
    on the CPU, where chain() runs the stages one after the other on the host."""
    return engine_state().side_stream(device) if device.type == "cuda" else None


# ------------------------------------------------------------------------------------------- forward
def dispatch(
    prep: PreparedAttention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Any,
    *,
    async_op: bool = False,
) -> Chain | None:
    """Send the query rows of every task and the KV-prefix rows it needs to its server (one all-to-all-v,
    two with the relay; KV rows go once per server even when several of its tasks read them)."""
    if not prep.communicates:
        return None
    ix, dev = prep.index, prep.device_index(q.device)
    kv_rows = dev.send_kv_rows
    streams = [
        (q.index_select(0, dev.send_q_rows), ix.send_q_counts),  # (Nq, Hq, D)
        (k.index_select(0, kv_rows), ix.send_kv_counts),  # (Nkv, Hkv, D)
        (v.index_select(0, kv_rows), ix.send_kv_counts),  # (Nkv, Hkv, D)
    ]
    first = _start(FWD_DISPATCH, streams, _received_counts(prep, 1)[0], group, async_op)
    return chain(first, _relay_forward(prep, FWD_DISPATCH, 1, group, async_op), _side_stream(q.device))


def compute(
    prep: PreparedAttention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    received: list[torch.Tensor] | None,
    kernel: Kernel,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This server's fused forward kernel over all its tasks: (out, lse) in kernel row order,
    (Tk, Hq, D) and (Tk, Hq) float32. ``sinks`` (Hq,) are applied here, on the server, to every row it
    computes (the returned outputs are final and the kept lse includes the sink); they must be equal on
    every rank (a replicated parameter)."""
    dev = prep.device_index(q.device)
    qi, kvi = dev.kernel_q_index, dev.kernel_kv_index
    # (Tk, Hq, D), (Tkv, Hkv, D), (Tkv, Hkv, D)
    q_kernel, k_kernel, v_kernel = _kernel_rows(
        [q, k, v], received, _received_counts(prep, 1), [qi, kvi, kvi]
    )
    if q_kernel.shape[0]:
        metrics.record_forward_kernel()
    return kernel.forward(q_kernel, k_kernel, v_kernel, prep.kernel_seqs(), prep.window, sinks)


def return_outputs(
    prep: PreparedAttention, out_kernel: torch.Tensor, group: Any, *, async_op: bool = False
) -> Exchange | None:
    """Send the output rows of other ranks' queries back to them (one all-to-all-v)."""
    if not prep.communicates:
        return None
    ix, dev = prep.index, prep.device_index(out_kernel.device)
    streams = [(out_kernel.index_select(0, dev.out_send_index), ix.out_send_counts)]  # (No, Hq, D)
    return _start(FWD_RETURN, streams, [ix.out_recv_counts], group, async_op)


def gather_outputs(
    prep: PreparedAttention, out_kernel: torch.Tensor, returned: torch.Tensor | None
) -> torch.Tensor:
    """This rank's outputs in local row order, (T_local, Hq, D), from its kernel rows and the returned rows
    (of one ping-pong part: its rows only, in local order)."""
    (pool,) = _pools([out_kernel], None if returned is None else [returned], [[prep.index.out_recv_counts]])
    return pool.index_select(0, prep.device_index(out_kernel.device).out_gather)


# ------------------------------------------------------------------------------------------ backward
def dispatch_backward(
    prep: PreparedAttention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    group: Any,
    *,
    async_op: bool = False,
) -> Chain | None:
    """Re-send what the servers need for their backward kernel: q, out and dout rows of their tasks and
    the KV-prefix rows (the servers kept only their log-sum-exp)."""
    if not prep.communicates:
        return None
    ix, dev = prep.index, prep.device_index(q.device)
    q_rows, kv_rows = dev.send_q_rows, dev.send_kv_rows
    streams = [
        (q.index_select(0, q_rows), ix.send_q_counts),  # (Nq, Hq, D)
        (out.index_select(0, q_rows), ix.send_q_counts),
        (dout.index_select(0, q_rows), ix.send_q_counts),
        (k.index_select(0, kv_rows), ix.send_kv_counts),  # (Nkv, Hkv, D)
        (v.index_select(0, kv_rows), ix.send_kv_counts),
    ]
    first = _start(BWD_DISPATCH, streams, _received_counts(prep, 3)[0], group, async_op)
    return chain(first, _relay_forward(prep, BWD_DISPATCH, 3, group, async_op), _side_stream(q.device))


def compute_backward(
    prep: PreparedAttention,
    fwd: ForwardTensors,
    dout: torch.Tensor,
    received: list[torch.Tensor] | None,
    kernel: Kernel,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """This server's backward kernel over all its tasks: dq (Tk, Hq, D), dk and dv (Tkv, Hkv, D) in
    kernel row order, and with ``sinks`` this server's share of their gradient (Hq,) (the sum over the
    rows it computed; the shares of all servers sum to the gradient), else None. ``fwd``: this rank's q,
    k, v and output in local row order and the server's log-sum-exp (Tk, Hq) in kernel row order."""
    q, k, v, out, lse = fwd
    dev = prep.device_index(q.device)
    qi, kvi = dev.kernel_q_index, dev.kernel_kv_index
    # (Tk, Hq, D) x 3, (Tkv, Hkv, D) x 2
    q_k, o_k, do_k, k_k, v_k = _kernel_rows(
        [q, out, dout, k, v], received, _received_counts(prep, 3), [qi, qi, qi, kvi, kvi]
    )
    return kernel.backward(
        ForwardTensors(q_k, k_k, v_k, o_k, lse), do_k, prep.kernel_seqs(), prep.window, sinks
    )


@dataclass
class GradReturn:
    """Gradients on their way home: the exchange in flight and this rank's own shares."""

    exchange: Chain | None
    dq_kernel: torch.Tensor
    """(Tk, Hq, D): dq of every kernel row (rows of other ranks' queries are in the exchange too)."""
    dk_local: torch.Tensor
    """(T_local, Hkv, D) in the accumulation dtype: dk of this rank's own rows from its own kernel."""
    dv_local: torch.Tensor


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def return_grads(
    prep: PreparedAttention,
    dq_kernel: torch.Tensor,
    dk_kernel: torch.Tensor,
    dv_kernel: torch.Tensor,
    group: Any,
    *,
    async_op: bool = False,
) -> GradReturn:
    """Sum dk/dv over the tasks of this server that read each KV row, then send dq to the query owners
    and dk/dv to the KV owners (one all-to-all-v; with the relay, first dk/dv of relayed rows to their
    relay inside the node, which adds them up, then one all-to-all-v as without it)."""
    ix, dev = prep.index, prep.device_index(dq_kernel.device)
    acc = _accumulation_dtype(dk_kernel.dtype)
    n, first_rows = ix.num_local, sum(ix.recv_kv_counts)
    relayed_rows = 0 if ix.relay is None else sum(ix.relay.recv_counts)
    # (T_local + R_kv [+ R_relayed], Hkv, D)
    dk_pool = dk_kernel.new_zeros(n + first_rows + relayed_rows, *dk_kernel.shape[1:], dtype=acc)
    dv_pool = dk_pool.clone()
    dk_pool.index_add_(0, dev.kernel_kv_index, dk_kernel.to(acc))
    dv_pool.index_add_(0, dev.kernel_kv_index, dv_kernel.to(acc))
    exchange = None
    if prep.communicates:
        dtype = dk_kernel.dtype

        def home() -> Exchange:
            streams = [
                (dq_kernel.index_select(0, dev.out_send_index), ix.out_send_counts),  # (No, Hq, D)
                (dk_pool[n : n + first_rows].to(dtype), ix.recv_kv_counts),  # (R_kv, Hkv, D), as they came
                (dv_pool[n : n + first_rows].to(dtype), ix.recv_kv_counts),
            ]
            recv = [ix.out_recv_counts, ix.send_kv_counts, ix.send_kv_counts]
            return _start(BWD_RETURN, streams, recv, group, async_op)

        if ix.relay is None:
            exchange = chain(home())
        else:
            relay = ix.relay
            streams = [  # to each relay of this node, in the order it forwarded them
                (dk_pool[n + first_rows :].to(dtype), relay.recv_counts),  # (R_relayed, Hkv, D)
                (dv_pool[n + first_rows :].to(dtype), relay.recv_counts),
            ]
            to_relays = _start(BWD_RETURN, streams, [relay.send_counts] * 2, group, async_op)
            shape = dk_pool.shape[1:]

            def sum_then_home(received: torch.Tensor) -> Exchange:
                dk_back, dv_back = _unpack(received, [relay.send_counts] * 2, [shape, shape])
                rows = n + dev.relay_send_rows
                dk_pool.index_add_(0, rows, torch.cat(dk_back).to(acc))
                dv_pool.index_add_(0, rows, torch.cat(dv_back).to(acc))
                return home()

            exchange = chain(to_relays, sum_then_home, _side_stream(dk_pool.device))
    return GradReturn(exchange, dq_kernel, dk_pool[:n], dv_pool[:n])


def gather_grads(
    prep: PreparedAttention, pending: GradReturn, kv_dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of this rank's rows in local order: own shares plus the returned ones (dk/dv of a row
    read by several servers summed). dq covers the rows whose queries ``prep`` computes (all local rows,
    or one part's); dk/dv cover every local row, in ``kv_dtype`` (None: the accumulation dtype,
    float32 for half-precision inputs, so that the shares of several parts sum before rounding)."""
    ix, dev = prep.index, prep.device_index(pending.dq_kernel.device)
    dk, dv = pending.dk_local, pending.dv_local
    kv_dtype = kv_dtype or dk.dtype
    if pending.exchange is None:
        dq = pending.dq_kernel.index_select(0, dev.out_gather)
        return dq, dk.to(kv_dtype), dv.to(kv_dtype)
    q_shape, kv_shape = pending.dq_kernel.shape[1:], dk.shape[1:]
    dq_back, dk_back, dv_back = _unpack(
        pending.exchange.wait()[-1],  # the last stage brings them home
        [ix.out_recv_counts, ix.send_kv_counts, ix.send_kv_counts],
        [q_shape, kv_shape, kv_shape],
    )
    dq = torch.cat([pending.dq_kernel, *dq_back]).index_select(0, dev.out_gather)  # (T_local, Hq, D)
    dk = dk.index_add(0, dev.send_kv_rows, torch.cat(dk_back).to(dk.dtype))  # (T_local, Hkv, D)
    dv = dv.index_add(0, dev.send_kv_rows, torch.cat(dv_back).to(dv.dtype))
    return dq, dk.to(kv_dtype), dv.to(kv_dtype)
