"""Rematerialization: a checkpoint's recompute reuses each attention call's forward result.

Plain activation checkpointing (``torch.utils.checkpoint``, non-reentrant, as Transformers uses it)
re-runs each decoder layer in backward to refill the tensors its operations saved; for ``distca`` that
means dispatching, computing and returning core attention a second time — the most expensive FLOPs and
most of the bytes of a long-context step. Non-reentrant checkpoint runs the ORIGINAL graph's backward
nodes; the recompute only refills their saved tensors, in save order, and checks their count and
metadata. So the attention operators (:mod:`hf_distca.engine.op`) save exactly (q, k, v, out) with
``save_for_backward`` and keep the log-sum-exp as an attribute, and :func:`remat_context_fn` is the
``context_fn`` for checkpoint that

- in the forward context: collects each attention call's output and log-sum-exp in a frame that
  belongs to this one checkpoint call (created by ``context_fn``, shared by its two contexts only);
- in the recompute context: hands them back, in call order, to the attention calls of the recompute,
  which then run a replay of the operator that saves the same four tensors (the recomputed q, k, v
  and the kept output) and returns the kept output, with no attention kernel and no communication.

The attention backward kernel is then the only core attention that runs in backward. Per layer this
keeps the attention output (T x Hq x D, the size of the layer's input) and the log-sum-exp (T x Hq,
float32) from forward to backward, in addition to the layer input that checkpointing keeps anyway.

The frames are per thread (a checkpoint's forward and its recompute run on the thread that entered it).
Where a frame keeps its results is up to the decoder layer call around the checkpoint
(:class:`KeptPlacement`, entered with :func:`placing_kept_attention`): on the device (the default), through
pack/unpack functions (host memory, :mod:`hf_distca.engine.offload`), or not at all (``drop``: that
checkpoint recomputes its attention like plain checkpointing).
Turning it on for a Transformers model: :mod:`hf_distca.checkpointing`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = [
    "CORE_FWD_OP",
    "KEPT_OPS",
    "LOCAL_FWD_OP",
    "KeptPlacement",
    "SavedAttention",
    "TRACED_REMAT_MIN_TORCH",
    "keep_for_recompute",
    "placing_kept_attention",
    "remat_context_fn",
    "take_saved_attention",
    "timing_attention",
    "traced",
]


@dataclass(frozen=True)
class SavedAttention:
    """One attention call's result, kept from the forward for its recompute."""

    out: Any
    """The output (detached: the frame never holds the autograd graph); in a frame, what its pack made of it."""
    lse: Any
    """The log-sum-exp the backward kernel needs (in the runner's kernel row order)."""
    runner: Any
    """What the operator's backward needs to run (the engine's prepared plan, or the local offsets)."""


def _same(tensor: Any) -> Any:
    return tensor


class _Frame:
    """The attention results of one checkpoint call, in call order, each kept as ``pack`` makes it and
    handed back through ``unpack``."""

    def __init__(self, pack: Callable[[Any], Any] = _same, unpack: Callable[[Any], Any] = _same) -> None:
        self.saved: list[SavedAttention] = []
        self.cursor = 0
        self.pack, self.unpack = pack, unpack


@dataclass
class KeptPlacement:
    """Where the rematerialization frame of the checkpoint called inside one decoder layer call keeps its
    attention results: through ``pack``/``unpack`` (None: as they are, on the device), or nowhere
    (``drop``). ``consulted``: a frame was asked for (the layer's checkpoint is rematerialization-aware).
    ``timings``: where :func:`timing_attention` appends (start, end) CUDA events of the layer call's core
    attention forwards (None: not timed)."""

    drop: bool = False
    pack: Callable[[Any], Any] | None = None
    unpack: Callable[[Any], Any] | None = None
    consulted: bool = False
    timings: list | None = None


def _placements() -> list[KeptPlacement]:
    if not hasattr(_state, "placements"):
        _state.placements = []
    return _state.placements


@contextlib.contextmanager
def placing_kept_attention(placement: KeptPlacement) -> Iterator[KeptPlacement]:
    """While active (on this thread), checkpoints that ask :func:`remat_context_fn` for a frame get one
    that keeps their attention results as ``placement`` says."""
    _placements().append(placement)
    try:
        yield placement
    finally:
        _placements().pop()


@contextlib.contextmanager
def timing_attention(q: torch.Tensor) -> Iterator[None]:
    """Around a core attention forward that runs its kernels (not a replay): CUDA events into the active
    placement's ``timings`` when it has them and ``q`` is on a CUDA device; else nothing."""
    placement = _placements()[-1] if _placements() else None
    timings = None if placement is None else placement.timings
    if timings is None or not q.is_cuda:
        yield
        return
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    yield
    end.record()
    timings.append((start, end))


_FORWARD, _RECOMPUTE = "forward", "recompute"
_state = threading.local()


def _stack() -> list[tuple[str, _Frame]]:
    if not hasattr(_state, "stack"):
        _state.stack = []
    return _state.stack


class _FrameContext:
    """Makes ``frame`` the current frame in ``mode`` while active (innermost checkpoint wins)."""

    def __init__(self, mode: str, frame: _Frame) -> None:
        self.mode, self.frame = mode, frame

    def __enter__(self) -> _FrameContext:
        if self.mode == _RECOMPUTE:
            self.frame.cursor = 0  # a second backward over a retained graph recomputes again
        _stack().append((self.mode, self.frame))
        return self

    def __exit__(self, *exc: object) -> None:
        _stack().pop()


CORE_FWD_OP = "hf_distca::core_attention_fwd"
LOCAL_FWD_OP = "hf_distca::local_attention_fwd"
KEPT_OPS = (CORE_FWD_OP, LOCAL_FWD_OP)
"""The engine's forward custom ops (:mod:`hf_distca.engine.compiled`) whose outputs (output and
log-sum-exp) a checkpoint traced inside torch.compile keeps."""


def _save_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective-checkpointing policy inside torch.compile: keep the attention ops' outputs, recompute the
    rest of the layer."""
    name = op.name() if hasattr(op, "name") else None
    return CheckpointPolicy.MUST_SAVE if name in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def traced() -> bool:
    """Whether a checkpoint called now is being traced for torch.compile: torch.utils.checkpoint then asks its
    ``context_fn`` for two TorchDispatchModes, exactly when a proxy mode is active. torch < 2.13 does not
    report that through ``torch.compiler.is_compiling()`` while AOTAutograd traces a checkpoint inside the
    compiled region (Transformers >= 5.25 checkpoints inside each decoder layer's forward, so compiling a
    layer traces it), hence the same test as torch's own."""
    if torch.compiler.is_compiling():
        return True
    proxy = getattr(torch._C, "_TorchDispatchModeKey", None)
    return proxy is not None and torch._C._get_dispatch_mode(proxy.PROXY) is not None


TRACED_REMAT_MIN_TORCH = (2, 13)
"""The oldest torch whose Inductor compiles the backward of a rematerialization-aware checkpoint traced
inside a compiled region (torch 2.11's fails on the attention statistics' plan-sized rows)."""


def _check_traced_remat_supported() -> None:
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if version < TRACED_REMAT_MIN_TORCH:
        raise RuntimeError(
            f"rematerialization-aware checkpointing traced inside torch.compile needs torch >= "
            f"{'.'.join(map(str, TRACED_REMAT_MIN_TORCH))}, this is torch {torch.__version__} (Transformers >= 5.25 "
            "checkpoints inside each decoder layer's forward, so compiling a layer or the model traces the "
            "checkpoint). Upgrade torch, or checkpoint with plain recompute (DistCACallback(recompute_attention=True)), "
            "or leave the model uncompiled"
        )


def remat_context_fn() -> tuple[Any, Any]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: a fresh frame
    and its (forward, recompute) context managers. Inside torch.compile (which traces checkpoint with
    selective-checkpointing contexts only) the same effect through torch's public selective checkpointing:
    the engine's compiled attention ops (:data:`KEPT_OPS`) are saved, never recomputed. A
    :class:`KeptPlacement` active on this thread says where the frame keeps them (or that there is none)."""
    if traced():
        # the placement is not read here: the hooks that enter it do not run inside a traced region, and a
        # layer whose placement was never consulted refuses host/drop (hf_distca.offloading)
        _check_traced_remat_supported()
        return create_selective_checkpoint_contexts(_save_attention)
    placement = _placements()[-1] if _placements() else None
    if placement is not None:
        placement.consulted = True
        if placement.drop:
            return contextlib.nullcontext(), contextlib.nullcontext()
        frame = _Frame(placement.pack or _same, placement.unpack or _same)
        return _FrameContext(_FORWARD, frame), _FrameContext(_RECOMPUTE, frame)
    frame = _Frame()
    return _FrameContext(_FORWARD, frame), _FrameContext(_RECOMPUTE, frame)


def keep_for_recompute(out: torch.Tensor, lse: torch.Tensor, runner: Any) -> None:
    """Called by the attention operators after a real forward: keep the result when a rematerialization-
    aware checkpoint is recording (no-op otherwise)."""
    stack = _stack()
    if stack and stack[-1][0] == _FORWARD:
        frame = stack[-1][1]
        frame.saved.append(SavedAttention(frame.pack(out.detach()), frame.pack(lse), runner))


def take_saved_attention(rows: int) -> SavedAttention | None:
    """Inside a rematerialization-aware recompute: the next kept attention result (for a call with
    ``rows`` query rows); None outside one."""
    stack = _stack()
    if not stack or stack[-1][0] != _RECOMPUTE:
        return None
    frame = stack[-1][1]
    # rank-local checks, and left so: the calls of a checkpointed layer and their rows follow from the
    # layer's code and its saved inputs, the same in forward and recompute on a deterministic layer on
    # every rank; they fail only for a layer that is not deterministic (a model bug, which may show on
    # one rank only). Deciding that together would need a collective in every layer's recompute
    if frame.cursor >= len(frame.saved):
        raise RuntimeError(
            f"rematerialization-aware checkpointing: the recompute calls attention {frame.cursor + 1} times but "
            f"the forward called it {len(frame.saved)} times; the checkpointed function must be deterministic. "
            "Use plain recompute (DistCACallback(recompute_attention=True) / no context_fn) for this model"
        )
    kept = frame.saved[frame.cursor]
    frame.cursor += 1
    # unpack copies back each time: a second backward over a retained graph gets them again
    saved = SavedAttention(frame.unpack(kept.out), frame.unpack(kept.lse), kept.runner)
    if saved.out.shape[0] != rows:
        raise RuntimeError(
            f"rematerialization-aware checkpointing: the recompute's attention call has {rows} query rows but the "
            f"forward's had {saved.out.shape[0]}; the checkpointed function must see the same inputs"
        )
    return saved
