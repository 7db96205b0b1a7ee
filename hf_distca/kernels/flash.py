"""flash_attn.flash_attn_varlen_func, used when the flash-attn package is installed (CUDA only)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def _flash_attn_varlen_func():
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # ImportError, or a broken CUDA extension build
        return None
    return flash_attn_varlen_func


def flash_attn_available() -> bool:
    return _flash_attn_varlen_func() is not None and torch.cuda.is_available()


def flash_attn_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    scale: float,
    causal: bool = True,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """See :func:`hf_distca.kernels.varlen_attention`. flash-attn >= 2.1 aligns causal bottom-right."""
    fn = _flash_attn_varlen_func()
    cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32)
    cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32)
    result = fn(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        return_attn_probs=return_lse,
    )
    if return_lse:
        out, lse = result[0], result[1]  # lse: (Hq, Tq)
        return out, lse.float().transpose(0, 1).contiguous()  # (Tq, Hq)
    return result
