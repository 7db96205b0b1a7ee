"""Varlen causal attention kernels behind one interface, with an explicit forward and backward.

Every backend takes packed (T, H, D) tensors with cumulative sequence offsets where
``cu_seqlens_q`` may differ from ``cu_seqlens_k``: sequence ``i`` pairs queries
``q[cu_q[i]:cu_q[i+1]]`` with keys ``k[cu_k[i]:cu_k[i+1]]``. Causal masking is aligned
bottom-right (query i of a sequence sees keys j <= i + (len_k - len_q)), which is exactly the shape of
a CA-task: a query shard at the end of a longer KV prefix. A sliding ``window`` (Transformers'
``sliding_window``: query position i sees key j iff 0 <= i - j < window) is supported by every backend
(torch_varlen needs torch >= 2.11's ``window_size``). GQA (fewer KV heads) is supported by every
backend. Attention logit softcapping (``softcap``, Gemma 2) is computed by the reference and flash_attn
(flash-attn >= 2.6) backends only; the others refuse it, naming those two. Attention sinks (``sinks``,
gpt-oss) are exact on every backend: they are applied to the output and log-sum-exp any backend returns
(:mod:`hf_distca.kernels.sinks`).

:func:`attention_forward` returns the output and the log-sum-exp of the scaled scores;
:func:`attention_backward` turns (q, k, v, out, lse, dout) into (dq, dk, dv). Neither is
differentiable: they are the pieces that the engine's autograd operator (:func:`hf_distca.core_attention`,
and :func:`hf_distca.local_attention` on one process) is built from, so that a caller can keep ``out`` and
``lse`` and run only the backward kernel later.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_distca.kernels import cudnn_backend, cudnn_frontend, flash, reference, torch_varlen
from hf_distca.kernels.common import (
    ForwardTensors,
    PackedSeqs,
    UnsupportedFeatureError,
    VarlenOffsets,
    check_backward_inputs,
    check_inputs,
    check_sinks,
    host_to_device,
)
from hf_distca.kernels.cudnn_backend import CudnnOptions
from hf_distca.kernels.reference import reference_varlen_attention
from hf_distca.kernels.sinks import sinks_backward as _sinks_backward
from hf_distca.kernels.sinks import with_sinks

__all__ = [
    "KERNEL_BACKENDS",
    "CudnnOptions",
    "ForwardTensors",
    "UnsupportedFeatureError",
    "VarlenOffsets",
    "attention_backward",
    "attention_forward",
    "available_backends",
    "host_to_device",
    "reference_varlen_attention",
    "resolve_backend",
    "sinks_backward",
]

_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class _Backend:
    available: Callable[[], bool]
    """Whether the backend's library imports and a CUDA device is present (always True for reference)."""
    cuda_half_only: bool
    """Runs only on CUDA tensors in float16/bfloat16."""
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    """(q, k, v, seqs, scale) -> (out, lse); cudnn also takes its CudnnOptions last."""
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """(dout, ForwardTensors(q, k, v, out, lse), seqs, scale) -> (dq, dk, dv); cudnn also takes its
    CudnnOptions last."""
    missing: str
    """What to install when ``available()`` is False."""
    window: Callable[[], bool] = lambda: True
    """Whether the backend computes a sliding window (``PackedSeqs.window``)."""
    missing_window: str = ""
    """What a sliding window needs when ``window()`` is False."""
    softcap: Callable[[], bool] = lambda: False
    """Whether the backend computes attention logit softcapping (``PackedSeqs.softcap``)."""


_BACKENDS: dict[str, _Backend] = {
    "cudnn": _Backend(
        cudnn_frontend.available,
        True,
        cudnn_backend.forward,
        cudnn_backend.backward,
        "NVIDIA's cudnn-frontend (pip install hf_distca[cudnn]) and a CUDA device",
    ),
    "torch_varlen": _Backend(
        torch_varlen.available,
        True,
        torch_varlen.forward,
        torch_varlen.backward,
        "torch.nn.attention.varlen (torch >= 2.10) and a CUDA device",
        torch_varlen.supports_window,
        "torch.nn.attention.varlen's window_size needs torch >= 2.11",
    ),
    "flash_attn": _Backend(
        flash.available,
        True,
        flash.forward,
        flash.backward,
        "flash-attn (pip install flash-attn) and CUDA",
        softcap=flash.supports_softcap,
    ),
    "reference": _Backend(
        lambda: True, False, reference.forward, reference.backward, "", softcap=lambda: True
    ),
}
KERNEL_BACKENDS = ("auto", *_BACKENDS)
"""The one list of kernel backend names (``DistCAConfig.backend``): "auto", then every backend in the order
"auto" prefers them (the registry's)."""


def _usable(name: str, device: torch.device, dtype: torch.dtype) -> bool:
    backend = _BACKENDS[name]
    if backend.cuda_half_only and (device.type != "cuda" or dtype not in _HALF):
        return False
    return backend.available()


def available_backends(device: torch.device, dtype: torch.dtype) -> list[str]:
    """Backends that can run on ``device`` with ``dtype``, best first (the order of KERNEL_BACKENDS)."""
    return [name for name in KERNEL_BACKENDS if name != "auto" and _usable(name, device, dtype)]


def resolve_backend(
    backend: str, device: torch.device, dtype: torch.dtype, *, softcap: float | None = None
) -> str:
    """Turn 'auto' into a concrete backend; raise a clear error for an impossible explicit choice.

    With ``softcap``, 'auto' takes the best backend that computes it, but never falls back from a fast
    GPU backend to the slow reference: it refuses instead, naming what would work."""
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; use one of {', '.join(KERNEL_BACKENDS)}")
    if backend == "auto":
        usable = available_backends(device, dtype)
        if softcap:
            capable = [name for name in usable if _BACKENDS[name].softcap()]
            if capable[0] == "reference" and usable[0] != "reference":
                _refuse_softcap(usable[0], softcap)
            return capable[0]
        return usable[0]
    if not _usable(backend, device, dtype):
        spec = _BACKENDS[backend]
        why = (
            f"it needs {spec.missing}"
            if not spec.available()
            else f"it needs a CUDA tensor in float16/bfloat16, got {device.type} {dtype}"
        )
        raise UnsupportedFeatureError(
            f"kernel backend {backend!r} cannot run here: {why}. Use backend='auto'."
        )
    return backend


def _refuse_softcap(name: str, softcap: float) -> None:
    raise UnsupportedFeatureError(
        f"kernel backend {name!r} cannot compute attention logit softcapping (softcap={softcap}: Gemma 2's "
        "attn_logit_softcapping, scores squashed to softcap * tanh(score / softcap)). Backends that compute it "
        "exactly: 'flash_attn' (CUDA, flash-attn >= 2.6: pip install flash-attn) and 'reference' (any device, "
        "exact but slow); choose one with DistCAConfig(backend=...) / --backend"
    )


def _options(name: str, cudnn_options: CudnnOptions | None) -> tuple[CudnnOptions, ...]:
    """The extra arguments of backend ``name``'s forward and backward: the cudnn options, when given."""
    if cudnn_options is None:
        return ()
    if name != "cudnn":
        raise ValueError(f"cudnn_options apply to the cudnn backend only, not to {name!r}; drop them")
    return (cudnn_options,)


def _check_features(seqs: PackedSeqs, name: str) -> None:
    """Refuse what backend ``name`` cannot compute (rather than computing other math)."""
    if seqs.window is not None and not _BACKENDS[name].window():
        raise UnsupportedFeatureError(
            f"kernel backend {name!r} cannot compute sliding-window attention here "
            f"({_BACKENDS[name].missing_window}); use backend='reference' or another backend"
        )
    if seqs.softcap is not None and not _BACKENDS[name].softcap():
        _refuse_softcap(name, seqs.softcap)


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqs: PackedSeqs,
    scale: float,
    name: str,
    cudnn_options: CudnnOptions | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_features(seqs, name)
    options = _options(name, cudnn_options)
    if q.shape[0] == 0:  # no query rows: nothing to run (GPU kernels may refuse empty launches)
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        return q.new_empty(q.shape), torch.empty(0, q.shape[1], dtype=lse_dtype, device=q.device)
    return _BACKENDS[name].forward(q, k, v, seqs, scale, *options)


def _backward(
    dout: torch.Tensor,
    fwd: ForwardTensors,
    seqs: PackedSeqs,
    scale: float,
    name: str,
    cudnn_options: CudnnOptions | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_features(seqs, name)
    options = _options(name, cudnn_options)
    if fwd.q.shape[0] == 0:
        return torch.zeros_like(fwd.q), torch.zeros_like(fwd.k), torch.zeros_like(fwd.v)
    dq, dk, dv = _BACKENDS[name].backward(dout, fwd, seqs, scale, *options)
    for i in range(seqs.num_seqs):
        if seqs.q_len(i) == 0 and seqs.k_len(i) > 0:  # keys nobody queries: zero whatever the kernel left
            dk[seqs.k_bounds[i] : seqs.k_bounds[i + 1]] = 0
            dv[seqs.k_bounds[i] : seqs.k_bounds[i + 1]] = 0
    return dq, dk, dv


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    scale: float | None = None,
    backend: str = "auto",
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    cudnn_options: CudnnOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal (bottom-right aligned) varlen attention forward; not differentiable.

    q: (Tq, Hq, D); k, v: (Tk, Hkv, D) with Hq % Hkv == 0; cu_seqlens_*: (N + 1,) int offsets with the
    same N (a sequence may have 0 queries, and then any number of keys; never more queries than keys).
    scale defaults to D ** -0.5; ``window``: the sliding window (None: full causal). Returns out (Tq, Hq, D)
    in q's dtype and lse (Tq, Hq), the natural-log log-sum-exp of the scaled scores, in float32 (float64
    for float64 inputs). Offsets on a GPU are read once on the host (one synchronisation); pass them on
    the CPU to avoid it. ``softcap``: attention logit softcapping (scores -> softcap * tanh(score / softcap)
    before the mask and softmax; None or 0: none). ``sinks``: (Hq,) attention-sink logits, one extra
    softmax column per row and head that carries no value (:mod:`hf_distca.kernels.sinks`); the returned
    lse then includes it, which is what :func:`attention_backward` takes (gradients of the sinks:
    :func:`sinks_backward`). ``cudnn_options``: how the cudnn backend runs (None: its defaults; only when the
    backend is cudnn).
    """
    offsets = VarlenOffsets(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    seqs = check_inputs(q, k, v, offsets, window, softcap)
    if sinks is not None:
        check_sinks(sinks, q)
    name = resolve_backend(backend, q.device, q.dtype, softcap=seqs.softcap)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = _forward(q, k, v, seqs, scale, name, cudnn_options)
    return (out, lse) if sinks is None else with_sinks(out, lse, sinks.detach())


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    scale: float | None = None,
    backend: str = "auto",
    window: int | None = None,
    softcap: float | None = None,
    cudnn_options: CudnnOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`attention_forward` from its inputs, its (out, lse) and dout; not differentiable.

    Returns dq like q and dk, dv like k, v (GQA: summed over each KV head's query group), in the inputs'
    dtypes. Keys of sequences without queries get zero gradients. ``out`` and ``lse`` must come from a
    forward of the same inputs, ``window`` and ``softcap`` (any backend: all agree up to rounding); with
    sinks, the forward's (out, lse) already hold them and these gradients are exact as they are. ``cudnn_options``: as in :func:`attention_forward`.
    """
    offsets = VarlenOffsets(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    seqs = check_inputs(q, k, v, offsets, window, softcap)
    check_backward_inputs(dout, q, out, lse)
    name = resolve_backend(backend, q.device, q.dtype, softcap=seqs.softcap)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _backward(dout, ForwardTensors(q, k, v, out, lse), seqs, scale, name, cudnn_options)


def sinks_backward(
    dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """Gradient of the attention sinks (Hq,) of rows whose :func:`attention_forward` with ``sinks`` gave
    ``out`` (Tq, Hq, D) and ``lse`` (Tq, Hq), from their dout: -sum over rows of p_sink * (dout . out)
    per head, in sinks' dtype. Rows may be any subset of a call's (a server's sum over its rows plus the
    other servers' sums is the whole gradient)."""
    check_sinks(sinks, out)
    check_backward_inputs(dout, out, out, lse)
    return _sinks_backward(dout, out, lse, sinks.detach())
