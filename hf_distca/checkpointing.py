"""Rematerialization-aware activation checkpointing: recompute a layer, never its core attention.

Plain activation checkpointing (``torch.utils.checkpoint``, non-reentrant, as Transformers uses it)
re-runs each decoder layer in backward to refill the tensors its operations saved; for ``distca`` that
means dispatching, computing and returning core attention a second time — the most expensive FLOPs and
most of the bytes of a long-context step. Non-reentrant checkpoint runs the ORIGINAL graph's backward
nodes; the recompute only refills their saved tensors, in save order, and checks their count and
metadata. So the attention operators (:mod:`hf_distca.engine.op`) save exactly (q, k, v, out) with
``save_for_backward`` and keep the log-sum-exp as an attribute, and this module passes a
``context_fn`` to checkpoint that

- in the forward context: collects each attention call's output and log-sum-exp in a frame that
  belongs to this one checkpoint call (created by ``context_fn``, shared by its two contexts only);
- in the recompute context: hands them back, in call order, to the attention calls of the recompute,
  which then run a replay of the operator that saves the same four tensors (the recomputed q, k, v
  and the kept output) and returns the kept output, with no attention kernel and no communication.

The attention backward kernel is then the only core attention that runs in backward. Per layer this
keeps the attention output (T x Hq x D, the size of the layer's input) and the log-sum-exp (T x Hq,
float32) from forward to backward, in addition to the layer input that checkpointing keeps anyway.

Use :func:`enable_remat_checkpointing` (the Trainer callback does it by default), or pass
:func:`remat_checkpointing_kwargs` as ``gradient_checkpointing_kwargs``.
"""

from __future__ import annotations

import threading
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts, noop_context_fn

__all__ = [
    "SavedAttention",
    "enable_remat_checkpointing",
    "remat_checkpointing_kwargs",
    "remat_context_fn",
    "switch_trainer_checkpointing",
    "unwrap_kernelized_forwards",
]


@dataclass(frozen=True)
class SavedAttention:
    """One attention call's result, kept from the forward for its recompute."""

    out: torch.Tensor
    """The output (detached: the frame never holds the autograd graph)."""
    lse: torch.Tensor
    """The log-sum-exp the backward kernel needs (in the runner's kernel row order)."""
    runner: Any
    """What the operator's backward needs to run (the engine's prepared plan, or the local offsets)."""


class _Frame:
    """The attention results of one checkpoint call, in call order."""

    def __init__(self) -> None:
        self.saved: list[SavedAttention] = []
        self.cursor = 0


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


def _save_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective-checkpointing policy inside torch.compile: keep the attention ops' outputs (output and
    log-sum-exp), recompute the rest of the layer."""
    from hf_distca.engine.compiled import attention_forward_ops  # the engine imports this module

    return CheckpointPolicy.MUST_SAVE if op in attention_forward_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _traced() -> bool:
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
    the engine's compiled attention ops (:mod:`hf_distca.engine.compiled`) are saved, never recomputed."""
    if _traced():
        _check_traced_remat_supported()
        return create_selective_checkpoint_contexts(_save_attention)
    frame = _Frame()
    return _FrameContext(_FORWARD, frame), _FrameContext(_RECOMPUTE, frame)


def keep_for_recompute(out: torch.Tensor, lse: torch.Tensor, runner: Any) -> None:
    """Called by the attention operators after a real forward: keep the result when a rematerialization-
    aware checkpoint is recording (no-op otherwise)."""
    stack = _stack()
    if stack and stack[-1][0] == _FORWARD:
        stack[-1][1].saved.append(SavedAttention(out.detach(), lse, runner))


def take_saved_attention(rows: int) -> SavedAttention | None:
    """Inside a rematerialization-aware recompute: the next kept attention result (for a call with
    ``rows`` query rows); None outside one."""
    stack = _stack()
    if not stack or stack[-1][0] != _RECOMPUTE:
        return None
    frame = stack[-1][1]
    if frame.cursor >= len(frame.saved):
        raise RuntimeError(
            f"rematerialization-aware checkpointing: the recompute calls attention {frame.cursor + 1} times but "
            f"the forward called it {len(frame.saved)} times; the checkpointed function must be deterministic. "
            "Use plain recompute (DistCACallback(recompute_attention=True) / no context_fn) for this model"
        )
    saved = frame.saved[frame.cursor]
    frame.cursor += 1
    if saved.out.shape[0] != rows:
        raise RuntimeError(
            f"rematerialization-aware checkpointing: the recompute's attention call has {rows} query rows but the "
            f"forward's had {saved.out.shape[0]}; the checkpointed function must see the same inputs"
        )
    return saved


class _Both:
    """Enters two context managers as one (ours inside the user's)."""

    def __init__(self, outer: Any, inner: Any) -> None:
        self.outer, self.inner = outer, inner

    def __enter__(self) -> _Both:
        self.outer.__enter__()
        try:
            self.inner.__enter__()
        except BaseException:
            self.outer.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> bool:
        suppressed = bool(self.inner.__exit__(*exc))
        if suppressed:
            exc = (None, None, None)
        return bool(self.outer.__exit__(*exc)) or suppressed


def _composed(user_context_fn: Callable[[], tuple[Any, Any]]) -> Callable[[], tuple[Any, Any]]:
    def context_fn() -> tuple[_Both, _Both]:
        if _traced():
            raise RuntimeError(
                "rematerialization-aware checkpointing with your own checkpoint context_fn cannot run inside "
                "torch.compile (it traces one selective-checkpointing context only); drop the context_fn, or use "
                "plain recompute (DistCACallback(recompute_attention=True))"
            )
        user_forward, user_recompute = user_context_fn()
        ours_forward, ours_recompute = remat_context_fn()
        return _Both(user_forward, ours_forward), _Both(user_recompute, ours_recompute)

    return context_fn


def remat_checkpointing_kwargs(checkpointing_kwargs: dict | None = None) -> dict:
    """Keyword arguments for ``torch.utils.checkpoint.checkpoint`` (e.g. Transformers'
    ``gradient_checkpointing_kwargs``) that make checkpointing rematerialization-aware, merged with the
    caller's: ``use_reentrant=False`` (required) and our ``context_fn`` (composed with the caller's own)."""
    kwargs = dict(checkpointing_kwargs or {})
    if kwargs.get("use_reentrant", False):
        raise ValueError(
            "rematerialization-aware checkpointing needs non-reentrant checkpointing; drop use_reentrant=True "
            "from the checkpointing kwargs (or keep plain recompute: DistCACallback(recompute_attention=True))"
        )
    kwargs["use_reentrant"] = False
    user_fn = kwargs.get("context_fn")
    plain = user_fn is None or user_fn is noop_context_fn
    kwargs["context_fn"] = remat_context_fn if plain else _composed(user_fn)
    return kwargs


def checkpointing_enabled(model: torch.nn.Module) -> bool:
    """Whether Transformers' activation (gradient) checkpointing is on for ``model``."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                return bool(getattr(model, name))
    return False


def enable_remat_checkpointing(model: torch.nn.Module, checkpointing_kwargs: dict | None = None) -> None:
    """Turn on activation checkpointing of a Transformers model with rematerialization-aware attention.

    ``checkpointing_kwargs``: what you would pass as ``gradient_checkpointing_kwargs`` (Transformers >= 5.24
    also takes ``every_n_layers`` and ``offload`` there, as TrainingArguments does); they are kept. Calling
    it again replaces the previous setting. Only ``attn_implementation="distca"`` attention is affected;
    for such a model the ``kernels`` package's forward wrappers are removed (:func:`unwrap_kernelized_forwards`)
    so that torch.compile can trace the checkpointed layers."""
    kwargs = dict(checkpointing_kwargs or {})
    layer_options = {name: kwargs.pop(name) for name in ("every_n_layers", "offload") if name in kwargs}
    kwargs = remat_checkpointing_kwargs(kwargs)
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == "distca":
        unwrap_kernelized_forwards(model)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, **layer_options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, **layer_options)


def unwrap_kernelized_forwards(model: torch.nn.Module) -> int:
    """Give each module whose class forward is wrapped by the ``kernels`` package's ``use_kernelized_func``
    (Transformers >= 5.25 wraps e.g. every Llama/Qwen2/Mistral attention module with it) its own unwrapped
    forward, as an instance attribute. The wrapper sets and resets a context variable around the forward,
    a Python side effect that torch.compile refuses inside a checkpointed region (``HOP: Unsafe side
    effect``), so a compiled, checkpointed model could not train. The unwrapped forward computes the same
    thing; what it gives up is the per-model routing of hub kernels for the functions the wrapper names
    (e.g. ``apply_rotary_pos_emb`` after ``model.kernelize()``), which run their torch implementation.
    Returns how many modules were unwrapped."""
    unwrapped = 0
    for module in model.modules():
        forward = type(module).forward
        inner = getattr(forward, "__wrapped__", None)
        # the wrapper gives each instance its kernel functions: the mark of use_kernelized_func
        if inner is None or "_kernel_funcs" not in vars(module) or "forward" in vars(module):
            continue
        module.forward = types.MethodType(inner, module)
        unwrapped += 1
    return unwrapped


def switch_trainer_checkpointing(model: torch.nn.Module, training_args: Any) -> bool:
    """Make the Trainer's activation checkpointing rematerialization-aware (what DistCACallback does at
    ``on_train_begin``, after the Trainer turned checkpointing on): only for a model whose attention is
    ``distca`` and that checkpoints; the user's checkpointing kwargs from ``training_args`` are kept.
    Returns whether it switched."""
    while not hasattr(model, "gradient_checkpointing_enable") and hasattr(model, "module"):
        model = model.module  # a DDP/FSDP/DeepSpeed wrapper around the Transformers model
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if (
        impl != "distca"
        or not hasattr(model, "gradient_checkpointing_enable")
        or not checkpointing_enabled(model)
    ):
        return False
    user = getattr(training_args, "activation_checkpointing_kwargs", None)
    if user is None:
        user = getattr(training_args, "gradient_checkpointing_kwargs", None)
    if dict(user or {}).get("use_reentrant", False):
        warnings.warn(
            "hf_distca: the checkpointing kwargs ask for use_reentrant=True, so core attention is recomputed "
            "in backward; drop use_reentrant to let distca keep its output instead",
            stacklevel=2,
        )
        return False
    enable_remat_checkpointing(model, user)
    return True
