"""The flash-attn package (FlashAttention-2), used only when it imports (CUDA only).

Untested in this project's CI and GPU runs (neither has flash-attn installed): it follows the package's
documented varlen forward (``flash_attn_varlen_func(..., return_attn_probs=True)`` for the
log-sum-exp) and calls the package's varlen backward function by the argument names its installed
version declares. flash-attn >= 2.1 aligns causal bottom-right and takes H_kv < H_q natively; a sliding
window W is its ``window_size=(W - 1, 0)`` with ``causal=True``.
"""

from __future__ import annotations

import functools
import inspect

import torch

from hf_distca.kernels.common import ForwardTensors, PackedSeqs, device_offsets


@functools.lru_cache(maxsize=1)
def _interface():
    try:
        from flash_attn import flash_attn_interface
    except Exception:  # ImportError, or a broken CUDA extension build
        return None
    return flash_attn_interface


def available() -> bool:
    return _interface() is not None and torch.cuda.is_available()


def supports_softcap() -> bool:
    """Whether the installed flash-attn computes softcapping (its varlen forward takes ``softcap``)."""
    return available() and "softcap" in inspect.signature(_interface().flash_attn_varlen_func).parameters


def _offsets(seqs: PackedSeqs, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return device_offsets(seqs.cu_seqlens_q, device), device_offsets(seqs.cu_seqlens_k, device)


def _window_size(seqs: PackedSeqs) -> tuple[int, int]:
    return (-1, 0) if seqs.window is None else (seqs.window - 1, 0)


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    cu_q, cu_k = _offsets(seqs, q.device)
    out, lse, _ = _interface().flash_attn_varlen_func(
        q,
        k,
        v,
        cu_q,
        cu_k,
        seqs.max_seqlen_q,
        seqs.max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=True,
        window_size=_window_size(seqs),
        return_attn_probs=True,
        **({"softcap": seqs.softcap} if seqs.softcap else {}),
    )
    return out, lse.float().transpose(0, 1).contiguous()  # (Hq, Tq) -> (Tq, Hq)


def backward(
    dout: torch.Tensor, fwd: ForwardTensors, seqs: PackedSeqs, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v, out, lse = fwd
    fn = _interface()._flash_attn_varlen_backward
    cu_q, cu_k = _offsets(seqs, q.device)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    values = {
        "dout": dout.contiguous(),
        "q": q,
        "k": k,
        "v": v,
        "out": out,
        "softmax_lse": lse.float().transpose(0, 1).contiguous(),  # (Hq, Tq)
        "dq": dq,
        "dk": dk,
        "dv": dv,
        "cu_seqlens_q": cu_q,
        "cu_seqlens_k": cu_k,
        "max_seqlen_q": seqs.max_seqlen_q,
        "max_seqlen_k": seqs.max_seqlen_k,
        "dropout_p": 0.0,
        "softmax_scale": scale,
        "causal": True,
        "window_size": _window_size(seqs),
        "window_size_left": _window_size(seqs)[0],
        "window_size_right": 0,
        "softcap": seqs.softcap or 0.0,
        "alibi_slopes": None,
        "deterministic": False,
        "rng_state": None,
    }
    params = inspect.signature(fn).parameters
    fn(**{name: values[name] for name in params if name in values})
    return dq, dk, dv
