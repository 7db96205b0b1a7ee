"""torch.nn.attention.varlen.varlen_attn (FlashAttention-2 inside) on CUDA.

torch 2.10 spells causal ``is_causal=True``; 2.11+ spells it ``window_size=(-1, 0)``. Both are
bottom-right aligned when cu_seqlens_q != cu_seqlens_k.
"""

from __future__ import annotations

import functools
import inspect

import torch


@functools.lru_cache(maxsize=1)
def _varlen_attn():
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    return varlen


def torch_varlen_available() -> bool:
    return _varlen_attn() is not None and torch.cuda.is_available()


@functools.lru_cache(maxsize=1)
def _parameters() -> frozenset[str]:
    return frozenset(inspect.signature(_varlen_attn().varlen_attn).parameters)


def torch_varlen_attention(
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
    """See :func:`hf_distca.kernels.varlen_attention`."""
    varlen = _varlen_attn()
    params = _parameters()
    kwargs = {"scale": scale}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        kwargs["is_causal"] = causal
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        elif "window_size" not in params:  # torch 2.10 (unverified there): keep the copy
            groups = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(groups, dim=1)  # (Tk, Hq, D)
            v = v.repeat_interleave(groups, dim=1)  # (Tk, Hq, D)
        # torch 2.11: FlashAttention-2 inside takes H_kv < H_q natively (checked on H200; the copy
        # cost up to 1.6x at 512-token documents)
    if return_lse:
        kwargs["return_aux"] = varlen.AuxRequest(lse=True)
    cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32)
    cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32)
    result = varlen.varlen_attn(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, **kwargs)
    if return_lse:
        out, lse = result
        lse = lse.float()
        if lse.shape[0] != q.shape[0]:  # some releases return (Hq, Tq)
            lse = lse.transpose(0, 1)
        return out, lse.contiguous()
    return result
