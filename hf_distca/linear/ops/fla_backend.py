"""flash-linear-attention's chunk kernels (package ``fla-core``, imported as ``fla``) as the 'fla' backend of
``recurrence``, and when they are safe to use.

fla kernels take (B, T, H, D) with B = 1 for packed sequences, ``cu_seqlens`` as a long tensor on the
device, and states (N, H, K, V) in float32; they support ``initial_state`` and ``output_final_state``
with gradients for both, which is all the sequence-parallel path needs. Mapping (the kinds of
:func:`fla_kind`):

- 'none' / 'const' (no decay / a fixed per-head constant): ``chunk_simple_gla`` with ``g_gamma``
- 'scalar' (per-token per-head gates, or a learnable constant): ``chunk_simple_gla`` with ``g``
- 'vector' (per key-dim decay (T, H, K)): ``chunk_gla``
- 'delta' (delta rule with a per-head gate, or none): ``chunk_gated_delta_rule``
- 'kda' (delta rule with a per key-dim gate, Kimi delta attention): ``chunk_kda``

fla-core 0.6 refuses, in backward, the gated ``chunk_bwd_dqkwg`` that 'scalar' and 'delta' go through on
Hopper GPUs with Triton >= 3.4.0 and < 3.7.1 (wrong results, fla issue #640), unless its TileLang backend
takes the call (``fla/ops/common/chunk_o.py``, ``fla/ops/common/backends/tilelang/__init__.py``).
:func:`fla_unsafe_reason` mirrors that rule as a pure function; ``resolve_linear_backend`` uses it so
that 'auto' never picks fla there and an explicit 'fla' fails before any kernel runs.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
from packaging.version import Version

from hf_distca.linear.ops.recurrence import Recurrence

__all__ = [
    "FLA_FIX",
    "FLA_KINDS",
    "fla_available",
    "fla_kind",
    "fla_stalled_reason",
    "fla_stalled_reason_on",
    "fla_unsafe_reason",
    "fla_unsafe_reason_on",
    "run_fla",
]

FLA_KINDS = ("none", "const", "scalar", "vector", "delta", "kda")
FLA_FIX = "Use backend='chunked' (or 'auto'), upgrade Triton to >= 3.7.1, or install tilelang (with nvcc)"
_GATED_DQKWG = ("scalar", "delta")  # the kinds whose backward runs fla's gated chunk_bwd_dqkwg
_TRITON_BROKEN = (Version("3.4.0"), Version("3.7.1"))  # [from, to) on Hopper


def fla_available() -> bool:
    """Whether flash-linear-attention's ops can be imported (needs triton)."""
    return importlib.util.find_spec("fla") is not None and importlib.util.find_spec("triton") is not None


def fla_kind(log_decay: torch.Tensor | None, beta: torch.Tensor | None) -> str:
    """Which fla kernel :func:`run_fla` runs for these gates (one of ``FLA_KINDS``)."""
    if beta is not None:
        return "kda" if log_decay is not None and log_decay.dim() == 3 else "delta"
    if log_decay is None:
        return "none"
    if log_decay.dim() == 3:
        return "vector"
    if log_decay.dim() == 1 and not log_decay.requires_grad:
        return "const"
    return "scalar"  # per-token gates; also a learnable constant, since fla gives g_gamma no gradient


def fla_unsafe_reason(
    kind: str | None,
    *,
    capability: tuple[int, int] | None,
    triton_version: str,
    tilelang: bool,
    float32: bool = False,
    device_name: str = "",
) -> str | None:
    """Why fla-core 0.6 would refuse (or get wrong) transition ``kind`` on this device; None when it is safe.

    ``capability``: the NVIDIA GPU's compute capability (None: not an NVIDIA GPU); ``device_name`` its name
    (fla counts 'NVIDIA H...' as Hopper too); ``triton_version``: ``triton.__version__``; ``tilelang``:
    fla's TileLang backend is usable (``tilelang`` importable, an nvcc found, not disabled by
    FLA_TILELANG=0); ``float32``: q is float32 (TileLang takes 'scalar' only then: fla keeps that kernel's
    states in float32 and TileLang wants them in q's dtype). ``kind`` None: any kind.
    """
    kinds = _GATED_DQKWG if kind is None else (kind,)
    if kind is not None and kind not in FLA_KINDS:
        raise ValueError(f"fla kind must be one of {FLA_KINDS}, got {kind!r}")
    if not any(k in _GATED_DQKWG for k in kinds):
        return None
    hopper = capability is not None and (capability[0] == 9 or "NVIDIA H" in device_name)
    if not hopper or not _TRITON_BROKEN[0] <= Version(triton_version) < _TRITON_BROKEN[1]:
        return None
    rescued = [k for k in kinds if tilelang and (k == "delta" or float32)]
    if len(rescued) == len(kinds):
        return None
    return (
        f"fla-core's gated chunk_bwd_dqkwg (the backward of its kernels for "
        f"{' and '.join(repr(k) for k in kinds if k not in rescued)}) "
        f"gives wrong results on Hopper GPUs with Triton >= 3.4.0 and < 3.7.1 (here Triton {triton_version}, "
        f"compute capability {capability[0]}.{capability[1]}), and fla raises in backward, unless its TileLang "
        "backend takes the call (tilelang installed with nvcc; for per-token scalar gates only with float32 q)"
    )


_SLOW_START = (
    "none",
    "const",
    "vector",
    "kda",
)  # the kinds fla computes correctly on Hopper + Triton < 3.7.1


def fla_stalled_reason(
    kind: str | None, *, capability: tuple[int, int] | None, triton_version: str, device_name: str = ""
) -> str | None:
    """Why ``backend='auto'`` leaves transition ``kind`` to 'chunked' although fla-core would compute it
    correctly: on Hopper with Triton < 3.7.1 the first call of fla's kernels takes minutes (H200, Triton
    3.6.0, small shapes: chunk_simple_gla's first forward+backward over 150 s, chunk_gla's unfinished after
    4 minutes; benchmarks/results/linear_hopper_h200.md), and fla's other kernels are wrong there
    (:func:`fla_unsafe_reason`). None elsewhere; an explicit ``backend='fla'`` still runs these kinds."""
    if kind not in _SLOW_START or capability is None:
        return None
    hopper = capability[0] == 9 or "NVIDIA H" in device_name
    if not hopper or Version(triton_version) >= _TRITON_BROKEN[1]:
        return None
    return (
        f"on Hopper with Triton {triton_version} (< 3.7.1) the first call of fla-core's kernel for {kind!r} "
        "takes minutes (on an H200: over 150 s for chunk_simple_gla, over 4 minutes for chunk_gla)"
    )


@functools.cache
def _cuda_facts(index: int) -> tuple[tuple[int, int] | None, str]:
    if torch.version.hip is not None:
        return None, ""
    return tuple(torch.cuda.get_device_capability(index)), torch.cuda.get_device_name(index)


@functools.cache
def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


@functools.cache
def _has_usable_nvcc() -> bool:
    try:
        from fla.utils import has_usable_nvcc
    except ImportError:
        return False
    return bool(has_usable_nvcc())


def _tilelang_usable() -> bool:
    """Whether fla would hand its gated chunk_bwd_dqkwg to its TileLang backend (fla-core 0.6's rule)."""
    if os.environ.get("FLA_TILELANG") == "0" or os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1":
        return False
    return importlib.util.find_spec("tilelang") is not None and _has_usable_nvcc()


def fla_stalled_reason_on(device: torch.device, kind: str | None) -> str | None:
    """:func:`fla_stalled_reason` for this process's CUDA ``device`` and Triton (None off CUDA)."""
    version = _triton_version() if device.type == "cuda" else None
    if version is None:
        return None
    capability, name = _cuda_facts(device.index if device.index is not None else torch.cuda.current_device())
    return fla_stalled_reason(kind, capability=capability, triton_version=version, device_name=name)


def fla_unsafe_reason_on(
    device: torch.device, kind: str | None, dtype: torch.dtype | None = None
) -> str | None:
    """:func:`fla_unsafe_reason` for this process's CUDA ``device``, Triton and TileLang (None off CUDA or
    without Triton); ``dtype``: q's dtype (None: not float32)."""
    version = _triton_version() if device.type == "cuda" else None
    if version is None:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    capability, name = _cuda_facts(index)
    return fla_unsafe_reason(
        kind,
        capability=capability,
        device_name=name,
        triton_version=version,
        tilelang=capability is not None and _tilelang_usable(),
        float32=dtype == torch.float32,
    )


def run_fla(call: Recurrence) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The backend 'fla' of :func:`hf_distca.linear.ops.local.recurrence`: the reference's math, on CUDA tensors."""
    q, k, v, bounds, log_decay, beta, scale, initial_state, output_final_state = call
    if not q.is_cuda:
        raise ValueError(
            "the 'fla' linear-attention backend runs on CUDA tensors; use backend='reference' or 'chunked' on CPU"
        )
    if not fla_available():
        raise ImportError("backend='fla' needs flash-linear-attention: pip install fla-core (and triton)")
    kind = fla_kind(log_decay, beta)
    reason = fla_unsafe_reason_on(q.device, kind, q.dtype)
    if reason is not None:
        raise ValueError(f"backend='fla' cannot run this {kind!r} transition: {reason}. {FLA_FIX}")
    t, h, _ = q.shape
    cu_cpu = torch.tensor(bounds, dtype=torch.long)
    cu = cu_cpu.to(q.device)
    q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)  # (1, T, H, D)
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    common = dict(
        scale=scale,
        initial_state=h0,
        output_final_state=output_final_state,
        cu_seqlens=cu,
        cu_seqlens_cpu=cu_cpu,
    )
    if kind == "vector":
        from fla.ops.gla import chunk_gla

        o, final = chunk_gla(q4, k4, v4, g=log_decay.float().unsqueeze(0), **common)
    elif kind in ("none", "const"):
        from fla.ops.simple_gla import chunk_simple_gla

        gamma = q.new_zeros(h, dtype=torch.float32) if log_decay is None else log_decay.float()
        o, final = chunk_simple_gla(q4, k4, v4, g_gamma=gamma, **common)
    elif kind == "scalar":
        from fla.ops.simple_gla import chunk_simple_gla

        g = log_decay.float().expand(t, h) if log_decay.dim() == 1 else log_decay.float()  # (T, H)
        o, final = chunk_simple_gla(q4, k4, v4, g=g.unsqueeze(0), **common)
    elif kind == "kda":
        from fla.ops.kda import chunk_kda

        o, final = chunk_kda(q4, k4, v4, g=log_decay.float().unsqueeze(0), beta=beta.unsqueeze(0), **common)
    else:  # delta
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        if log_decay is None:
            g = q.new_zeros((t, h), dtype=torch.float32)
        else:
            g = log_decay.float().expand(t, h) if log_decay.dim() == 1 else log_decay.float()  # (T, H)
        o, final = chunk_gated_delta_rule(q4, k4, v4, g=g.unsqueeze(0), beta=beta.unsqueeze(0), **common)
    return o.squeeze(0), final
