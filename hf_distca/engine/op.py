"""The attention operators: one autograd.Function with an explicit forward and backward.

``core_attention`` (balanced over the ranks of a group) and ``local_attention`` (one process, its own
documents) both run through :class:`_AttentionOp`; they differ only in the runner that does the work:

- :class:`PingPongRunner`: forward = dispatch -> compute -> return_outputs -> gather_outputs; backward =
  dispatch_backward -> compute_backward -> return_grads -> gather_grads (see :mod:`.stages`), on the
  ping-pong parts of the micro-batch (:mod:`.ping_pong`; ``DistCAConfig.ping_pong``), interleaved so that one
  part's exchanges fly while another's kernel runs, in forward and backward; without ping-pong on
  the micro-batch as one part, the stages one after the other.
- :class:`LocalRunner`: the kernel's forward and backward on this process's own rows.

Inside an interleaved forward (layer-level ping-pong, :mod:`.interleave`) :func:`core_attention` runs the
same stages as three chained autograd nodes instead (:mod:`.layer_op`), switching to the other nano-batch
after each exchange starts.

Every stage a runner runs is a profiler range named ``distca.<fwd|bwd>.<stage>[.<part>]`` (stages:
dispatch, wait_dispatch, compute, return, wait_return; no part number with one part), so a
``torch.profiler`` trace shows the schedule (benchmarks/bench_ping_pong.py summarises it per layer).

What is kept from forward to backward, per layer and rank (T: local rows, Tk: rows of the tasks this
rank serves, both ~T after balancing; Hq/Hkv heads, D head_dim, b bytes per element):

- the owner's q, k, v and output (``save_for_backward``): T x (2 Hq + 2 Hkv) x D x b — what any
  attention implementation keeps; under activation checkpointing these are dropped and refilled by the
  recompute, except the output, which rematerialization-aware checkpointing keeps (T x Hq x D x b) so
  that attention is not recomputed (:mod:`hf_distca.engine.remat`);
- the server's log-sum-exp (an attribute, in its kernel row order): Tk x Hq x 4 bytes;
- nothing else: the server frees the q/k/v rows it received once its forward kernel has run.
Transient, within one stage: the server's pools (its rows plus the received ones) and their kernel-order
copies (a KV prefix read by two tasks twice); in backward the same for q, out, dout, k, v, plus float32
dk/dv accumulators for bf16/fp16 inputs.

Bytes per layer: what each of the four exchanges carries is written once, in the traffic ledger
(:mod:`hf_distca.planning.traffic`: q, k, v out and the outputs back in forward; q, out, dout, k, v out
and dq, dk, dv back in backward). Summed over ranks that is what plain activation recompute cost with an
engine that kept the received rows until backward, and one forward's exchanges less than plain recompute
with this engine. Rematerialization-aware checkpointing adds nothing.
Ping-pong sends the same Q rows, outputs and gradients, and a KV row once per part that reads
it: the same bytes with the default split; with ``ping_pong_split="halves"`` more only for a document
whose tasks on one server are cut between the two parts (see :mod:`.ping_pong`). The server's
log-sum-exp is kept per part (the same rows in all).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_distca import metrics
from hf_distca.config import DistCAConfig
from hf_distca.engine import interleave, stages
from hf_distca.engine.consistency import CallerInputError
from hf_distca.engine.layer_op import interleaved_core_attention
from hf_distca.engine.ping_pong import PartSplit, ping_pong_parts, whole
from hf_distca.engine.prepare import PreparedAttention, prepare
from hf_distca.engine.remat import SavedAttention, keep_for_recompute, take_saved_attention, timing_attention
from hf_distca.engine.stages import Kernel, stage_range
from hf_distca.engine.state import EngineState
from hf_distca.kernels import ForwardTensors, VarlenOffsets


def _wait(exchange) -> torch.Tensor | None:
    return None if exchange is None else exchange.wait()


@dataclass(frozen=True)
class PingPongRunner:
    """Balanced core attention of one micro-batch as ping-pong parts (:mod:`.ping_pong`: with ping-pong's default
    split, the work needing no exchange in two halves around the work that does; without ping-pong one
    part, the serial schedule) whose exchanges are asynchronous and interleave with the other parts'
    server kernels (all ranks call together).

    Forward: start every part's dispatch; then for each part in turn: wait for its dispatch, run its
    kernel, start its return; then wait for the returns and put the outputs in local row order. So a
    part's dispatch is in flight during the kernels of the parts before it, and its return during the
    kernels of the parts after it (a part that exchanges nothing starts and waits for nothing). Backward:
    the same with dispatch_backward, compute_backward and return_grads; dk/dv of all parts are summed in
    the accumulation dtype before rounding. The log-sum-exp is the parts' kernel rows one after the
    other. Stage names carry the part's number (``fwd.dispatch.0``), except with one part
    (``fwd.dispatch``)."""

    split: PartSplit
    group: Any
    kernel: Kernel
    """How the server kernels run (scale, backend, logit softcap)."""

    def _name(self, stage: str, j: int) -> str:
        return stage if len(self.split.parts) == 1 else f"{stage}.{j}"

    @property
    def overlaps(self) -> bool:
        """Whether exchanges are asynchronous: only with several parts. One part has nothing to hide its
        exchanges behind, so they block (serial execution keeps the blocking path measured over NCCL)."""
        return len(self.split.parts) > 1

    def _in_local_order(self, per_part: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The parts' rows (each in its computed rows' order) in local row order."""
        if len(per_part) == 1:
            return per_part[0]
        return torch.cat(per_part).index_select(0, self.split.local_order(device))

    def _interleave(self, pass_: str, start: Callable, run: Callable, finish: Callable) -> list:
        """One pass's schedule: every part's ``start(part)`` (its dispatch), then per part: wait for it,
        ``run(j, part, received)`` (its kernel) and ``finish(part, result)`` (start its return); returns
        the returns in flight. Nothing a part received outlives its kernel."""
        parts, name = self.split.parts, self._name
        in_flight = []
        for j, part in enumerate(parts):
            with stage_range(name(f"{pass_}.dispatch", j)):
                in_flight.append(start(part))
        returning = []
        for j, part in enumerate(parts):
            with stage_range(name(f"{pass_}.wait_dispatch", j)):
                received = _wait(in_flight[j])
            in_flight[j] = None  # the received rows are freed once the kernel has run
            with stage_range(name(f"{pass_}.compute", j)):
                result = run(j, part, received)
            del received
            with stage_range(name(f"{pass_}.return", j)):
                returning.append(finish(part, result))
            del result
        return returning

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        parts, group, name = self.split.parts, self.group, self._name
        outs, lses = [], []

        def run(j, part, received):
            out_kernel, lse = stages.compute(part, q, k, v, received, self.kernel, sinks)
            outs.append(out_kernel)
            lses.append(lse)
            return out_kernel

        returning = self._interleave(
            "fwd",
            lambda part: stages.dispatch(part, q, k, v, group, async_op=self.overlaps),
            run,
            lambda part, out_kernel: stages.return_outputs(part, out_kernel, group, async_op=self.overlaps),
        )
        gathered = []
        for j, part in enumerate(parts):
            with stage_range(name("fwd.wait_return", j)):
                returned = _wait(returning[j])
            gathered.append(stages.gather_outputs(part, outs[j], returned))  # (rows_j, Hq, D)
        out = self._in_local_order(gathered, q.device)  # (T_local, Hq, D)
        return out, (lses[0] if len(lses) == 1 else torch.cat(lses))  # lse: (Tk_0 + Tk_1 + ..., Hq)

    def backward(
        self, fwd: ForwardTensors, dout: torch.Tensor, sinks: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        q, k, v, out, lse = fwd
        parts, group, name = self.split.parts, self.group, self._name
        lses = lse.split([len(part.index.kernel_q_index) for part in parts])
        dsinks = []  # per part, this server's share of the sinks' gradient

        def run(j, part, received):
            part_fwd = ForwardTensors(q, k, v, out, lses[j])
            *grads, dsinks_j = stages.compute_backward(part, part_fwd, dout, received, self.kernel, sinks)
            dsinks.append(dsinks_j)
            return grads

        returning = self._interleave(
            "bwd",
            lambda part: stages.dispatch_backward(part, q, k, v, out, dout, group, async_op=self.overlaps),
            run,
            lambda part, grads: stages.return_grads(
                part, *grads, group, async_op=self.overlaps
            ),  # grads: dq, dk, dv
        )
        dqs, dk, dv = [], None, None
        for j, part in enumerate(parts):
            with stage_range(name("bwd.wait_return", j)):
                dq_j, dk_j, dv_j = stages.gather_grads(part, returning[j], None)  # dk/dv: accumulation dtype
            returning[j] = None
            dqs.append(dq_j)  # (rows_j, Hq, D)
            dk, dv = (dk_j, dv_j) if dk is None else (dk + dk_j, dv + dv_j)  # (T_local, Hkv, D)
        dq = self._in_local_order(dqs, q.device)  # (T_local, Hq, D)
        dsink = None if sinks is None else torch.stack(dsinks).sum(0)  # (Hq,)
        return dq, dk.to(k.dtype), dv.to(k.dtype), dsink


@dataclass(frozen=True)
class LocalRunner:
    """Causal attention of this process's own sequences (no communication)."""

    offsets: VarlenOffsets
    kernel: Kernel
    window: int | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if q.shape[0]:
            metrics.record_forward_kernel()
        return self.kernel.forward(q, k, v, self.offsets, self.window, sinks)

    def backward(
        self, fwd: ForwardTensors, dout: torch.Tensor, sinks: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return self.kernel.backward(fwd, dout.contiguous(), self.offsets, self.window, sinks)


class _AttentionOp(torch.autograd.Function):
    """out = attention(q, k, v) by ``runner`` (with attention ``sinks`` when given: a differentiable
    input); or, with ``saved`` (a rematerialization-aware recompute), the kept output without running
    anything. Saves exactly (q, k, v, out) either way, so that checkpointing's recompute refills the
    original node's saved tensors one for one (the sinks, a leaf parameter, are kept as an attribute)."""

    @staticmethod
    def forward(ctx, q, k, v, runner, saved: SavedAttention | None, sinks=None):  # type: ignore[override]
        if saved is None:
            with timing_attention(q):
                out, lse = runner.forward(q, k, v, sinks)
            keep_for_recompute(out, lse, runner)
        else:
            out, lse, runner = saved.out.view_as(saved.out), saved.lse, saved.runner
        ctx.save_for_backward(q, k, v, out)
        ctx.lse, ctx.runner, ctx.sinks = lse, runner, sinks
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out = ctx.saved_tensors
        dq, dk, dv, dsinks = ctx.runner.backward(ForwardTensors(q, k, v, out, ctx.lse), dout, ctx.sinks)
        return dq, dk, dv, None, None, dsinks


def _replay(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, saved: SavedAttention, sinks: torch.Tensor | None
) -> torch.Tensor:
    metrics.record_replay()
    return _AttentionOp.apply(q, k, v, saved.runner, saved, sinks)


def core_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pieces: Sequence[Sequence[int]],
    *,
    group: Any = None,
    config: DistCAConfig | None = None,
    scale: float | None = None,
    all_pieces: Sequence[Sequence[Sequence[int]]] | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    state: EngineState | None = None,
    caller_error: CallerInputError | None = None,
) -> torch.Tensor:
    """Causal per-document attention of this rank's queries, computed by balanced attention servers.

    q: (T_local, H_q, D); k, v: (T_local, H_kv, D), this rank's tokens in local order.
    pieces: this rank's ``(doc_id, doc_start, length)`` runs in local order (doc ids are global).
    group: the attention-server process group (None: the world when torch.distributed is
    initialized, else a single process). Every rank of the group must call collectively.
    all_pieces: every rank's pieces, when the caller already has them (skips an all-gather per call);
    pass one object per micro-batch and reuse it for every layer: the ranks' inputs are checked against
    each other on the first call with each new object (see :mod:`hf_distca.engine.prepare`).
    window: the layer's sliding window (Transformers' ``sliding_window``; None: full causal): a query
    shard then reads and is sent only the keys of its window, and the plan balances windowed work.
    softcap: attention logit softcapping (Gemma 2; backends 'reference' and 'flash_attn').
    sinks: (H_q,) attention-sink logits (gpt-oss), equal on every rank; the servers apply them to the rows
    they compute and each rank's gradient of them is its server's share (the sum over ranks, as data
    parallelism sums parameter gradients, is the gradient).
    state: the engine state whose caches and probe results it uses (None: the process's,
    :func:`hf_distca.engine.state.engine_state`; a model's runtime passes its own).
    caller_error: what the caller found wrong with this rank's call (the attention function: a padded or
    several-row batch with a layout); raised on every rank of the group together, at the consistency check.
    Returns (T_local, H_q, D), differentiable w.r.t. q, k, v (and sinks). Inside a rematerialization-aware
    checkpoint recompute, returns the output kept from the forward (no planning, no communication).
    """
    saved = take_saved_attention(q.shape[0])
    if saved is not None:
        return _replay(q, k, v, saved, sinks)
    config = config or DistCAConfig()
    prepared = prepare(
        q, k, v, pieces, group=group, config=config, all_pieces=all_pieces, window=window, state=state,
        caller_error=caller_error,
    )  # fmt: skip
    metrics.record_call(prepared.flops_before, prepared.flops_after)
    here = interleave.current()
    if here is not None:  # a nano-batch of an interleaved forward: its exchanges around the other's work
        here[0].first_call_prepared(here[1])  # every nano-batch's checks before the first exchange
        runner = PingPongRunner(whole(prepared), group, Kernel(scale, config.backend, softcap))
        return interleaved_core_attention(q, k, v, prepared, *here, runner=runner, sinks=sinks)
    runner = engine_runner(
        prepared, group=group, config=config, scale=scale, on_cuda=q.is_cuda, softcap=softcap
    )
    return _AttentionOp.apply(q, k, v, runner, None, sinks)


def engine_runner(
    prepared: PreparedAttention,
    *,
    group: Any,
    config: DistCAConfig,
    scale: float | None,
    on_cuda: bool,
    softcap: float | None = None,
) -> PingPongRunner:
    """The runner of one prepared micro-batch: ping-pong parts when ``config.ping_pong`` asks for
    them (None: on CUDA tensors) and the plan communicates, else the micro-batch as one part (serial)."""
    ping_pong = config.ping_pong if config.ping_pong is not None else on_cuda
    if ping_pong and prepared.communicates:  # every rank decides alike: same config, same plan
        split = ping_pong_parts(prepared, config.shard_tokens, config.ping_pong_split)
    else:
        split = whole(prepared)
    return PingPongRunner(split, group, Kernel(scale, config.backend, softcap))


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    scale: float | None = None,
    backend: str = "auto",
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal (bottom-right aligned) varlen attention of this process's own sequences, differentiable
    (w.r.t. q, k, v and ``sinks``), with the same operator as :func:`core_attention` (so
    rematerialization-aware checkpointing applies). Arguments as :func:`hf_distca.kernels.attention_forward`."""
    saved = take_saved_attention(q.shape[0])
    if saved is not None:
        return _replay(q, k, v, saved, sinks)
    offsets = VarlenOffsets(cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
    runner = LocalRunner(offsets, Kernel(scale, backend, softcap), window)
    return _AttentionOp.apply(q, k, v, runner, None, sinks)
