"""torch.nn.attention.varlen (FlashAttention-2 inside) on CUDA: forward and backward as separate calls.

The forward is the public ``varlen_attn`` with ``return_aux=AuxRequest(lse=True)``. The backward is
the op that ``varlen_attn`` registers as its own gradient, ``torch.ops.torch_attn._varlen_attn_backward``;
its arguments grew over releases (2.10: no scale/window_size; 2.11: scale, window_size; later ones a
backend index), so it is called by the names its schema declares. Without that op,
``aten._flash_attention_backward`` is called directly. Both align causal bottom-right when
cu_seqlens_q != cu_seqlens_k. The log-sum-exp is (Hq, Tq) inside FlashAttention; the interface's is
(Tq, Hq). A sliding window W is FlashAttention's ``window_size=(W - 1, 0)`` (bottom-right aligned like
causal; torch >= 2.11, whose varlen_attn has ``window_size``).
"""

from __future__ import annotations

import functools
import inspect

import torch

from hf_distca.kernels.common import ForwardTensors, PackedSeqs, device_offsets


@functools.lru_cache(maxsize=1)
def _varlen_module():
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    return varlen


def available() -> bool:
    return _varlen_module() is not None and torch.cuda.is_available()


@functools.lru_cache(maxsize=1)
def _parameters() -> frozenset[str]:
    return frozenset(inspect.signature(_varlen_module().varlen_attn).parameters)


def supports_window() -> bool:
    """Whether this torch's varlen_attn takes ``window_size`` (sliding windows; torch >= 2.11)."""
    return _varlen_module() is not None and "window_size" in _parameters()


def _window_size(seqs: PackedSeqs) -> tuple[int, int]:
    """FlashAttention's (left, right): causal (-1, 0), or W - 1 keys to the left under a window W."""
    return (-1, 0) if seqs.window is None else (seqs.window - 1, 0)


def _native_gqa() -> bool:
    """torch >= 2.11 passes H_kv < H_q to FlashAttention-2 (checked on H200; 2.10 gets repeated K/V)."""
    params = _parameters()
    return "enable_gqa" in params or "window_size" in params


@functools.lru_cache(maxsize=1)
def _backward_op_arguments() -> frozenset[str] | None:
    """Argument names of torch_attn::_varlen_attn_backward, or None when this torch has no such op."""
    _varlen_module()  # importing the module registers the op
    try:
        op = torch.ops.torch_attn._varlen_attn_backward.default
    except (AttributeError, RuntimeError):
        return None
    return frozenset(arg.name for arg in op._schema.arguments)


def _device_offsets(seqs: PackedSeqs, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return device_offsets(seqs.cu_seqlens_q, device), device_offsets(seqs.cu_seqlens_k, device)


def _kernel_kv(t: torch.Tensor, hq: int) -> torch.Tensor:
    """K or V as the kernel takes it: as is with native GQA, else repeated to Hq heads (Tk, Hq, D)."""
    if t.shape[1] == hq or _native_gqa():
        return t
    return t.repeat_interleave(hq // t.shape[1], dim=1)


MAX_ELEMENTS = 2**31 - 1
"""The most elements a tensor may hold here: past 2**31 (e.g. q of 524288 rows of 32 x 128 heads) torch's
varlen kernel wrote non-finite outputs on an H200 (torch 2.11)."""


def check_elements(q: torch.Tensor, k: torch.Tensor) -> None:
    """Refuse calls whose q or K/V (as the kernel takes them: repeated to q's heads without native GQA)
    hold more than :data:`MAX_ELEMENTS`."""
    hq, hkv = q.shape[1], k.shape[1]
    kv = k.numel() if hq == hkv or _native_gqa() else k.numel() // hkv * hq
    for name, elements in (("q", q.numel()), ("k and v", kv)):
        if elements > MAX_ELEMENTS:
            raise ValueError(
                f"backend 'torch_varlen': {name} of this call hold {elements} elements, past the 2**31 - 1 its "
                "kernel indexes correctly (it computed non-finite outputs there); use backend 'cudnn' (exact past "
                "2**31, tested) or fewer tokens per attention call"
            )


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    check_elements(q, k)
    varlen = _varlen_module()
    params = _parameters()
    kwargs = {"scale": scale, "return_aux": varlen.AuxRequest(lse=True)}
    if "window_size" in params:
        kwargs["window_size"] = _window_size(seqs)
    else:
        kwargs["is_causal"] = True
    if "enable_gqa" in params and k.shape[1] != q.shape[1]:
        kwargs["enable_gqa"] = True
    cu_q, cu_k = _device_offsets(seqs, q.device)
    hq = q.shape[1]
    out, lse = varlen.varlen_attn(
        q, _kernel_kv(k, hq), _kernel_kv(v, hq), cu_q, cu_k, seqs.max_seqlen_q, seqs.max_seqlen_k, **kwargs
    )
    if lse.shape == (hq, q.shape[0]):  # FlashAttention's layout (Hq, Tq)
        lse = lse.transpose(0, 1)
    return out, lse.float().contiguous()  # (Tq, Hq)


def backward(
    dout: torch.Tensor, fwd: ForwardTensors, seqs: PackedSeqs, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v, out, lse = fwd
    check_elements(q, k)
    cu_q, cu_k = _device_offsets(seqs, q.device)
    hq, hkv = q.shape[1], k.shape[1]
    lse_kernel = lse.float().transpose(0, 1).contiguous()  # (Hq, Tq)
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: never read
    kk, vv = _kernel_kv(k, hq), _kernel_kv(v, hq)
    names = _backward_op_arguments()
    if names is not None:
        wanted = {
            "grad_out": dout.contiguous(),
            "query": q,
            "key": kk,
            "value": vv,
            "out": out,
            "lse": lse_kernel,
            "cu_seq_q": cu_q,
            "cu_seq_k": cu_k,
            "max_q": seqs.max_seqlen_q,
            "max_k": seqs.max_seqlen_k,
            "is_causal": seqs.window is None,  # a window is non-causal with window_size (W - 1, 0)
            "rng_state": rng_state,
            "scale": scale,
            "window_size": list(_window_size(seqs)),
        }
        dq, dk, dv = torch.ops.torch_attn._varlen_attn_backward(
            **{name: value for name, value in wanted.items() if name in names}
        )
    else:
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(),
            q,
            kk,
            vv,
            out,
            lse_kernel,
            cu_q,
            cu_k,
            seqs.max_seqlen_q,
            seqs.max_seqlen_k,
            0.0,
            seqs.window is None,
            rng_state,
            torch.empty(0, device=q.device),
            scale=scale,
            window_size_left=_window_size(seqs)[0],
            window_size_right=0,
        )
    if dk.shape[1] != hkv:  # repeated K/V: sum each KV head's query group
        groups = hq // hkv
        dk = dk.view(dk.shape[0], hkv, groups, dk.shape[2]).sum(2)  # (Tk, Hkv, D)
        dv = dv.view(dv.shape[0], hkv, groups, dv.shape[2]).sum(2)  # (Tk, Hkv, D)
    return dq, dk, dv
