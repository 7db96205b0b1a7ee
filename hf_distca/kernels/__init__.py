"""Varlen causal attention kernels behind one interface.

Every backend takes packed (T, H, D) tensors with cumulative sequence offsets where
``cu_seqlens_q`` may differ from ``cu_seqlens_k``: sequence ``i`` pairs queries
``q[cu_q[i]:cu_q[i+1]]`` with keys ``k[cu_k[i]:cu_k[i+1]]``. Causal masking is aligned
bottom-right (the last query sees the last key), which is exactly the shape of a CA-task: a query
shard at the end of a longer KV prefix. GQA (fewer KV heads) is supported by every backend.
"""

from __future__ import annotations

import torch

from hf_distca.kernels.common import UnsupportedFeatureError, check_features, check_shapes
from hf_distca.kernels.flash import flash_attn_available, flash_attn_varlen
from hf_distca.kernels.reference import reference_varlen_attention
from hf_distca.kernels.torch_varlen import torch_varlen_attention, torch_varlen_available

__all__ = [
    "UnsupportedFeatureError",
    "available_backends",
    "resolve_backend",
    "varlen_attention",
    "reference_varlen_attention",
]

_HALF = (torch.float16, torch.bfloat16)


def available_backends(device: torch.device, dtype: torch.dtype) -> list[str]:
    """Backends that can run on ``device`` with ``dtype``, best first."""
    names = []
    if device.type == "cuda" and dtype in _HALF:
        if flash_attn_available():
            names.append("flash_attn")
        if torch_varlen_available():
            names.append("torch_varlen")
    names.append("reference")
    return names


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """Turn 'auto' into a concrete backend; raise a clear error for an impossible explicit choice."""
    usable = available_backends(device, dtype)
    if backend == "auto":
        return usable[0]
    if backend not in ("reference", "torch_varlen", "flash_attn"):
        raise ValueError(
            f"unknown kernel backend {backend!r}; use auto, reference, torch_varlen or flash_attn"
        )
    if backend not in usable:
        why = (
            "flash-attn is not installed (pip install flash-attn)"
            if backend == "flash_attn" and not flash_attn_available()
            else f"it needs a CUDA tensor in float16/bfloat16, got {device.type} {dtype}"
        )
        raise UnsupportedFeatureError(
            f"kernel backend {backend!r} cannot run here: {why}. Use backend='auto'."
        )
    return backend


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    scale: float | None = None,
    causal: bool = True,
    return_lse: bool = False,
    backend: str = "auto",
    sliding_window: int | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal (bottom-right aligned) varlen attention.

    q: (Tq, Hq, D); k, v: (Tk, Hkv, D) with Hq % Hkv == 0; cu_seqlens_*: (N + 1,) int offsets.
    Returns out (Tq, Hq, D) in q's dtype, and with ``return_lse`` also the log-sum-exp of the scaled
    scores, (Tq, Hq) float32. Features no backend here implements (sliding window, softcap, dropout,
    attention sinks) raise :class:`UnsupportedFeatureError` rather than being ignored.
    """
    check_features(sliding_window=sliding_window, softcap=softcap, dropout=dropout, sinks=sinks)
    check_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    name = resolve_backend(backend, q.device, q.dtype)
    if name == "flash_attn":
        fn = flash_attn_varlen
    elif name == "torch_varlen":
        fn = torch_varlen_attention
    else:
        fn = reference_varlen_attention
    return fn(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        int(max_seqlen_q),
        int(max_seqlen_k),
        scale=scale,
        causal=causal,
        return_lse=return_lse,
    )
