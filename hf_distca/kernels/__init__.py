"""Varlen causal attention kernels behind one interface, with an explicit forward and backward.

Every backend takes packed (T, H, D) tensors with cumulative sequence offsets where
``cu_seqlens_q`` may differ from ``cu_seqlens_k``: sequence ``i`` pairs queries
``q[cu_q[i]:cu_q[i+1]]`` with keys ``k[cu_k[i]:cu_k[i+1]]``. Causal masking is aligned
bottom-right (query i of a sequence sees keys j <= i + (len_k - len_q)), which is exactly the shape of
a CA-task: a query shard at the end of a longer KV prefix. A sliding ``window`` (Transformers'
``sliding_window``: query position i sees key j iff 0 <= i - j < window) is supported by every backend
(torch_varlen needs torch >= 2.11's ``window_size``). GQA (fewer KV heads) is supported by every
backend.

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

from hf_distca.config import KERNEL_BACKENDS
from hf_distca.kernels import cudnn_frontend, flash, reference, torch_varlen
from hf_distca.kernels.common import PackedSeqs, UnsupportedFeatureError, check_backward_inputs, check_inputs
from hf_distca.kernels.cudnn_frontend import CudnnOptions
from hf_distca.kernels.reference import reference_varlen_attention

__all__ = [
    "CudnnOptions",
    "UnsupportedFeatureError",
    "attention_backward",
    "attention_forward",
    "available_backends",
    "reference_varlen_attention",
    "resolve_backend",
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
    """(dout, q, k, v, out, lse, seqs, scale) -> (dq, dk, dv); cudnn also takes its CudnnOptions last."""
    missing: str
    """What to install when ``available()`` is False."""
    window: Callable[[], bool] = lambda: True
    """Whether the backend computes a sliding window (``PackedSeqs.window``)."""
    missing_window: str = ""
    """What a sliding window needs when ``window()`` is False."""


_BACKENDS: dict[str, _Backend] = {
    "cudnn": _Backend(
        cudnn_frontend.available,
        True,
        cudnn_frontend.forward,
        cudnn_frontend.backward,
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
        flash.available, True, flash.forward, flash.backward, "flash-attn (pip install flash-attn) and CUDA"
    ),
    "reference": _Backend(lambda: True, False, reference.forward, reference.backward, ""),
}
# config.KERNEL_BACKENDS is the one list of names: 'auto' first, then every backend best first
if set(KERNEL_BACKENDS) != {"auto", *_BACKENDS}:
    raise RuntimeError(
        f"config.KERNEL_BACKENDS {KERNEL_BACKENDS} and the kernel registry {list(_BACKENDS)} differ"
    )


def _usable(name: str, device: torch.device, dtype: torch.dtype) -> bool:
    backend = _BACKENDS[name]
    if backend.cuda_half_only and (device.type != "cuda" or dtype not in _HALF):
        return False
    return backend.available()


def available_backends(device: torch.device, dtype: torch.dtype) -> list[str]:
    """Backends that can run on ``device`` with ``dtype``, best first (the order of KERNEL_BACKENDS)."""
    return [name for name in KERNEL_BACKENDS if name != "auto" and _usable(name, device, dtype)]


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """Turn 'auto' into a concrete backend; raise a clear error for an impossible explicit choice."""
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; use one of {', '.join(KERNEL_BACKENDS)}")
    if backend == "auto":
        return available_backends(device, dtype)[0]
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


def _options(name: str, cudnn_options: CudnnOptions | None) -> tuple[CudnnOptions, ...]:
    """The extra arguments of backend ``name``'s forward and backward: the cudnn options, when given."""
    if cudnn_options is None:
        return ()
    if name != "cudnn":
        raise ValueError(f"cudnn_options apply to the cudnn backend only, not to {name!r}; drop them")
    return (cudnn_options,)


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqs: PackedSeqs,
    scale: float,
    name: str,
    cudnn_options: CudnnOptions | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    options = _options(name, cudnn_options)
    if seqs.window is not None and not _BACKENDS[name].window():
        raise UnsupportedFeatureError(
            f"kernel backend {name!r} cannot compute sliding-window attention here "
            f"({_BACKENDS[name].missing_window}); use backend='reference' or another backend"
        )
    if q.shape[0] == 0:  # no query rows: nothing to run (GPU kernels may refuse empty launches)
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        return q.new_empty(q.shape), torch.empty(0, q.shape[1], dtype=lse_dtype, device=q.device)
    return _BACKENDS[name].forward(q, k, v, seqs, scale, *options)


def _backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    seqs: PackedSeqs,
    scale: float,
    name: str,
    cudnn_options: CudnnOptions | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    options = _options(name, cudnn_options)
    if q.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dq, dk, dv = _BACKENDS[name].backward(dout, q, k, v, out, lse, seqs, scale, *options)
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
    cudnn_options: CudnnOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal (bottom-right aligned) varlen attention forward; not differentiable.

    q: (Tq, Hq, D); k, v: (Tk, Hkv, D) with Hq % Hkv == 0; cu_seqlens_*: (N + 1,) int offsets with the
    same N (a sequence may have 0 queries, and then any number of keys; never more queries than keys).
    scale defaults to D ** -0.5; ``window``: the sliding window (None: full causal). Returns out (Tq, Hq, D)
    in q's dtype and lse (Tq, Hq), the natural-log log-sum-exp of the scaled scores, in float32 (float64
    for float64 inputs). Offsets on a GPU are read once on the host (one synchronisation); pass them on
    the CPU to avoid it. ``cudnn_options``: how the cudnn backend runs (None: its defaults; only when the
    backend is cudnn).
    """
    seqs = check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window)
    name = resolve_backend(backend, q.device, q.dtype)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _forward(q, k, v, seqs, scale, name, cudnn_options)


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
    cudnn_options: CudnnOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`attention_forward` from its inputs, its (out, lse) and dout; not differentiable.

    Returns dq like q and dk, dv like k, v (GQA: summed over each KV head's query group), in the inputs'
    dtypes. Keys of sequences without queries get zero gradients. ``out`` and ``lse`` must come from a
    forward of the same inputs and ``window`` (any backend: all agree up to rounding). ``cudnn_options``:
    as in :func:`attention_forward`.
    """
    seqs = check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window)
    check_backward_inputs(dout, q, out, lse)
    name = resolve_backend(backend, q.device, q.dtype)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _backward(dout, q, k, v, out, lse, seqs, scale, name, cudnn_options)
