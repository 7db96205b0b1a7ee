"""Checks shared by every kernel backend."""

from __future__ import annotations

import torch


class UnsupportedFeatureError(ValueError):
    """An attention feature the distca kernels do not implement (raised instead of computing wrong math)."""


def check_features(
    *, sliding_window: int | None, softcap: float | None, dropout: float, sinks: torch.Tensor | None
) -> None:
    """Refuse features that would otherwise be silently ignored."""
    if sliding_window is not None:
        raise UnsupportedFeatureError(
            f"sliding-window attention (window={sliding_window}) is not supported by the distca kernels; "
            "use a model config with sliding_window=None (or use_sliding_window=False)"
        )
    if softcap is not None and softcap != 0:
        raise UnsupportedFeatureError(
            f"attention logit softcapping (softcap={softcap}) is not supported by the distca kernels; "
            "use attn_implementation='eager' for this model"
        )
    if dropout:
        raise UnsupportedFeatureError(
            f"attention dropout (p={dropout}) is not supported by the distca kernels; set the config's "
            "attention_dropout=0.0"
        )
    if sinks is not None:
        raise UnsupportedFeatureError(
            "attention sinks are not supported by the distca kernels; use attn_implementation='eager'"
        )


def check_shapes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor
) -> None:
    """Validate the packed layout (cheap: no device synchronisation)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"varlen attention expects q, k, v shaped (T, H, D); got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k head_dim differ: {q.shape[-1]} vs {k.shape[-1]}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if cu_q.dim() != 1 or cu_k.dim() != 1 or cu_q.numel() != cu_k.numel():
        raise ValueError(
            "cu_seqlens_q and cu_seqlens_k must be 1-D with the same number of entries (N + 1), got "
            f"{tuple(cu_q.shape)} and {tuple(cu_k.shape)}"
        )
