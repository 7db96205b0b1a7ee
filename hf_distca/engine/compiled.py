"""The attention operators as ``torch.library`` custom ops: the ``distca`` attention inside ``torch.compile``.

A compiled region may not read tensor values on the host, yet planning, index building and document
boundaries are host work. Inside ``torch.compile`` the attention function therefore hands each call to
an opaque custom op whose implementation does that work exactly as the eager operators do (the same
runners, :mod:`.op`), with an explicit backward op; the compiler traces the rest of the decoder layer
around it, also with ``fullgraph=True``.

- ``hf_distca::core_attention_fwd`` / ``_bwd``: the balanced engine. The micro-batch's layout reaches the
  op as a 0-d int64 token tensor (:func:`register_layout`): a graph input, so a new layout never
  recompiles. The runtime (group and config) is an integer key (:func:`register_runtime`, one per
  model), a constant of the graph.
- ``hf_distca::local_attention_fwd`` / ``_bwd``: one process's packed documents, their boundaries derived
  inside the op from ``cu_seq_lens`` or position ids (one row per document without either).

Forward returns the output and the log-sum-exp (its rows are the server kernel's, a size only the plan
knows: an unbacked size for the compiler); backward rebuilds the same runner from the token (plans are
cached; a rebuilt plan is identical) and runs the eager runner's backward.

Under ``mode="reduce-overhead"`` (CUDA graphs) the ops run between the captured partitions: they carry
``torch.Tag.cudagraph_unsafe``.

Rematerialization-aware checkpointing (:mod:`hf_distca.engine.remat`) holds either way: a checkpoint traced
inside the compiled region keeps these ops' outputs by torch's selective checkpointing; an eager checkpoint
around a compiled region (each decoder layer compiled) hands the kept results to these ops at run time.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from hf_distca import metrics
from hf_distca.engine.op import LocalRunner, engine_runner
from hf_distca.engine.prepare import prepare
from hf_distca.engine.remat import CORE_FWD_OP, LOCAL_FWD_OP, keep_for_recompute, take_saved_attention
from hf_distca.engine.stages import Kernel
from hf_distca.engine.state import RUNNER_CACHE_SIZE, engine_state
from hf_distca.kernels import ForwardTensors, VarlenOffsets
from hf_distca.packing import cu_seqlens_from_lengths, packed_document_lengths

__all__ = [
    "compiled_core_attention",
    "compiled_local_attention",
    "register_layout",
    "register_runtime",
]

# The ops read plans and offsets on the host and exchange rows with other ranks: never inside a CUDA graph.
# Inductor's graph partitioning (on by default since torch 2.9) splits a mode="reduce-overhead" graph around
# ops tagged so, and replays only the partitions between them.
_OUTSIDE_CUDA_GRAPHS = (torch.Tag.cudagraph_unsafe,)


def register_layout(layout: Any) -> torch.Tensor:
    """A 0-d int64 CPU tensor naming ``layout`` (an object with ``pieces`` and ``all_pieces``) for the
    compiled ops, in the process's engine state; the layout is held weakly: keep it alive until its
    backward has run (the batch does)."""
    state = engine_state()
    return torch.tensor(state.name(layout, state.layouts), dtype=torch.int64)


def register_runtime(runtime: Any) -> int:
    """The integer key of ``runtime`` (a :class:`hf_distca.attention.DistCARuntime`: ``group``, ``config``
    and its engine ``state``) in the process's engine state, held weakly."""
    state = engine_state()
    return state.name(runtime, state.runtimes)


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _lookup(registry: weakref.WeakValueDictionary, key: int, what: str) -> Any:
    found = registry.get(key)
    if found is None:
        raise RuntimeError(
            f"the {what} of this compiled distca attention call is gone (key {key}): keep the batch (its "
            "distca_layout) and the model's runtime alive until backward has run"
        )
    return found


def _refuse_capture() -> None:
    """Raise when a CUDA graph is being captured around an attention op (see ``_OUTSIDE_CUDA_GRAPHS``)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "the distca attention ops cannot run inside a CUDA graph (they plan on the host and exchange rows "
            "with other ranks): compile with Inductor's graph partitioning on (torch._inductor.config."
            "graph_partition=True, the default of recent torch), which keeps them out of the graphs, or use "
            'mode="default" / "max-autotune-no-cudagraphs"'
        )


def _kept(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Inside the recompute of an eager rematerialization-aware checkpoint around a compiled region (e.g.
    each decoder layer compiled): the output and log-sum-exp its forward kept (copies: an op's outputs
    own their memory); else None."""
    saved = take_saved_attention(q.shape[0])
    if saved is None:
        return None
    metrics.record_replay()
    return saved.out.clone(), saved.lse.clone()


def _keep(runner: Any, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    keep_for_recompute(out, lse, runner)  # a no-op unless an eager remat checkpoint is recording
    return out, lse


def _core_runner(q, k, v, token: torch.Tensor, runtime_key: int, scale: float | None, window: int | None):
    """(runner, prepared) of one micro-batch and layer window, cached by layout, runtime, scale, window and
    shapes (a model's local and global layers share the layout, not the plan)."""
    layout_key = int(token)
    key = (layout_key, runtime_key, scale, window, tuple(q.shape), tuple(k.shape), q.dtype, str(q.device))
    names = engine_state()
    runtime = _lookup(names.runtimes, runtime_key, "runtime")
    runners = runtime.state.runners
    hit = runners.get(key)
    if hit is not None:
        runners.move_to_end(key)
        return hit
    layout = _lookup(names.layouts, layout_key, "layout")
    prepared = prepare(q, k, v, layout.pieces, group=runtime.group, config=runtime.config,
                       all_pieces=layout.all_pieces, window=window, state=runtime.state)  # fmt: skip
    runner = engine_runner(
        prepared, group=runtime.group, config=runtime.config, scale=scale, on_cuda=q.is_cuda
    )
    runners[key] = (runner, prepared)
    if len(runners) > RUNNER_CACHE_SIZE:
        runners.popitem(last=False)
    return runner, prepared


@torch.library.custom_op(CORE_FWD_OP, mutates_args=(), tags=_OUTSIDE_CUDA_GRAPHS)
def _core_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    token: torch.Tensor,
    runtime_key: int,
    scale: float | None,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _refuse_capture()
    saved = _kept(q)
    if saved is not None:
        return saved
    runner, prepared = _core_runner(q, k, v, token, runtime_key, scale, window)
    metrics.record_call(prepared.flops_before, prepared.flops_after)
    return _keep(runner, *runner.forward(q, k, v))


@_core_fwd.register_fake
def _core_fwd_fake(q, k, v, token, runtime_key, scale, window):
    rows = torch.library.get_ctx().new_dynamic_size()  # the server kernel's rows: the plan decides
    return torch.empty_like(q), q.new_empty((rows, q.shape[1]), dtype=_lse_dtype(q))


@torch.library.custom_op("hf_distca::core_attention_bwd", mutates_args=(), tags=_OUTSIDE_CUDA_GRAPHS)
def _core_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    token: torch.Tensor,
    runtime_key: int,
    scale: float | None,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    runner, _ = _core_runner(q, k, v, token, runtime_key, scale, window)
    dq, dk, dv, _ = runner.backward(ForwardTensors(q, k, v, out, lse), dout)
    return dq, dk, dv


@_core_bwd.register_fake
def _core_bwd_fake(dout, q, k, v, out, lse, token, runtime_key, scale, window):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _core_setup(ctx, inputs, output) -> None:
    q, k, v, token, runtime_key, scale, window = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, token)
    ctx.args = (runtime_key, scale, window)


def _core_backward(ctx, dout, _dlse):
    q, k, v, out, lse, token = ctx.saved_tensors
    dq, dk, dv = _core_bwd(dout.contiguous(), q, k, v, out, lse, token, *ctx.args)
    return dq, dk, dv, None, None, None, None


_core_fwd.register_autograd(_core_backward, setup_context=_core_setup)


def compiled_core_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    token: torch.Tensor,
    runtime_key: int,
    *,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """:func:`hf_distca.engine.core_attention` of the layout named by ``token`` (:func:`register_layout`)
    with the runtime named by ``runtime_key`` (:func:`register_runtime`), as one custom op.

    q: (T_local, Hq, D); k, v: (T_local, Hkv, D). ``window``: the layer's sliding window (None: full
    causal). Returns (T_local, Hq, D), differentiable w.r.t. q, k and v."""
    out, _ = _core_fwd(q, k, v, token, runtime_key, scale, window)
    return out


# ------------------------------------------------------------------------------ one process, no layout
def _local_runner(q, cu_seq_lens, position_ids, batch: int, scale, backend: str, window: int | None):
    lengths = packed_document_lengths(
        batch, q.shape[0] // batch, cu_seq_lens_q=cu_seq_lens, position_ids=position_ids
    )
    longest = max(lengths, default=0)
    cu = cu_seqlens_from_lengths(lengths, device=torch.device("cpu"))
    return LocalRunner(VarlenOffsets(cu, cu, longest, longest), Kernel(scale, backend), window)


@torch.library.custom_op(LOCAL_FWD_OP, mutates_args=(), tags=_OUTSIDE_CUDA_GRAPHS)
def _local_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seq_lens: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    batch: int,
    scale: float | None,
    backend: str,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _refuse_capture()
    saved = _kept(q)
    if saved is not None:
        return saved
    runner = _local_runner(q, cu_seq_lens, position_ids, batch, scale, backend, window)
    return _keep(runner, *runner.forward(q, k, v))


@_local_fwd.register_fake
def _local_fwd_fake(q, k, v, cu_seq_lens, position_ids, batch, scale, backend, window):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=_lse_dtype(q))


@torch.library.custom_op("hf_distca::local_attention_bwd", mutates_args=(), tags=_OUTSIDE_CUDA_GRAPHS)
def _local_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seq_lens: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    batch: int,
    scale: float | None,
    backend: str,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    runner = _local_runner(q, cu_seq_lens, position_ids, batch, scale, backend, window)
    dq, dk, dv, _ = runner.backward(ForwardTensors(q, k, v, out, lse), dout)
    return dq, dk, dv


@_local_bwd.register_fake
def _local_bwd_fake(dout, q, k, v, out, lse, cu_seq_lens, position_ids, batch, scale, backend, window):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _local_setup(ctx, inputs, output) -> None:
    q, k, v, cu_seq_lens, position_ids, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seq_lens, position_ids)
    ctx.args = tuple(args)


def _local_backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seq_lens, position_ids = ctx.saved_tensors
    dq, dk, dv = _local_bwd(dout.contiguous(), q, k, v, out, lse, cu_seq_lens, position_ids, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


_local_fwd.register_autograd(_local_backward, setup_context=_local_setup)


def compiled_local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    batch: int,
    cu_seq_lens: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of ``batch`` unpadded rows of packed documents (boundaries as
    :func:`hf_distca.packing.packed_document_lengths` derives them), as one custom op.

    q: (B * S, Hq, D); k, v: (B * S, Hkv, D). Returns (B * S, Hq, D), differentiable w.r.t. q, k and v."""
    out, _ = _local_fwd(q, k, v, cu_seq_lens, position_ids, batch, scale, backend, window)
    return out
