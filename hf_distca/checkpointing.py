"""Rematerialization-aware activation checkpointing for Transformers models: recompute a layer, never its
core attention.

The mechanism (what a checkpoint keeps and hands back) is the engine's, :mod:`hf_distca.engine.remat`;
this module turns it on: :func:`enable_remat_checkpointing` for a model (the Trainer callback does it by
default, :func:`switch_trainer_checkpointing`), or :func:`remat_checkpointing_kwargs` as
``gradient_checkpointing_kwargs``.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import noop_context_fn

from hf_distca.engine.remat import remat_context_fn, traced

__all__ = [
    "checkpointing_enabled",
    "enable_remat_checkpointing",
    "remat_checkpointing_kwargs",
    "switch_trainer_checkpointing",
    "unwrap_kernelized_forwards",
]


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
        if traced():
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
