"""Input validation shared by every kernel backend, and the packed-sequence description they receive."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch


class UnsupportedFeatureError(ValueError):
    """An attention feature or backend the distca kernels cannot run (raised instead of computing wrong math)."""


@dataclass(frozen=True)
class PackedSeqs:
    """The packed sequences of one kernel call, validated once and shared by forward and backward.

    Sequence ``i`` pairs queries ``q[q_bounds[i]:q_bounds[i + 1]]`` with keys
    ``k[k_bounds[i]:k_bounds[i + 1]]``; causal masking is aligned bottom-right: query r of a sequence
    (position r + len_k - len_q of its keys) sees keys j with 0 <= r + len_k - len_q - j < window
    (every earlier key when ``window`` is None).
    """

    cu_seqlens_q: torch.Tensor
    """(N + 1,) int offsets of the query rows, as the caller passed them (any device)."""
    cu_seqlens_k: torch.Tensor
    """(N + 1,) int offsets of the key/value rows."""
    max_seqlen_q: int
    """Upper bound on any sequence's query count (kernels size their grids by it)."""
    max_seqlen_k: int
    """Upper bound on any sequence's key count."""
    q_bounds: tuple[int, ...]
    """Host copy of cu_seqlens_q."""
    k_bounds: tuple[int, ...]
    """Host copy of cu_seqlens_k."""
    window: int | None = None
    """Sliding window (Transformers' ``sliding_window``): keys at most window - 1 positions before the
    query; None: full causal."""
    softcap: float | None = None
    """Attention logit softcapping (Gemma 2's ``attn_logit_softcapping``): each scaled score s becomes
    softcap * tanh(s / softcap) before the softmax; None: plain scores."""

    @property
    def num_seqs(self) -> int:
        return len(self.q_bounds) - 1

    def q_len(self, i: int) -> int:
        return self.q_bounds[i + 1] - self.q_bounds[i]

    def k_len(self, i: int) -> int:
        return self.k_bounds[i + 1] - self.k_bounds[i]


class VarlenOffsets(NamedTuple):
    """The offsets of a varlen call's packed sequences, as flash-attn's varlen API (and
    :func:`attention_forward`) takes them."""

    cu_seqlens_q: torch.Tensor
    """(N + 1,) int offsets of the query rows."""
    cu_seqlens_k: torch.Tensor
    """(N + 1,) int offsets of the key/value rows."""
    max_seqlen_q: int
    """Upper bound on any sequence's query count."""
    max_seqlen_k: int
    """Upper bound on any sequence's key count."""


class ForwardTensors(NamedTuple):
    """What every backend's backward reads of its forward: the inputs and the forward's results."""

    q: torch.Tensor
    """(Tq, Hq, D)"""
    k: torch.Tensor
    """(Tk, Hkv, D)"""
    v: torch.Tensor
    """(Tk, Hkv, D)"""
    out: torch.Tensor
    """(Tq, Hq, D), the forward's output"""
    lse: torch.Tensor
    """(Tq, Hq), the forward's log-sum-exp of the scaled scores"""


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: VarlenOffsets,
    window: int | None = None,
    softcap: float | None = None,
) -> PackedSeqs:
    """Validate the packed sequences and return them with host copies of the offsets.

    Reading the offsets on the host synchronises with the device when they live on a GPU; callers
    that want to avoid the synchronisation pass them on the CPU (backends move them as needed).
    """
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = offsets
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"varlen attention expects q, k, v shaped (T, H, D); got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k head_dim differ: {q.shape[-1]} vs {k.shape[-1]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if cu_seqlens_q.dim() != 1 or cu_seqlens_k.dim() != 1 or cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            "cu_seqlens_q and cu_seqlens_k must be 1-D with the same number of entries (N + 1), got "
            f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}"
        )
    if cu_seqlens_q.numel() == 0 or cu_seqlens_q.is_floating_point() or cu_seqlens_k.is_floating_point():
        raise ValueError("cu_seqlens_q/k must be non-empty integer tensors starting at 0")
    q_bounds = tuple(int(x) for x in cu_seqlens_q.tolist())
    k_bounds = tuple(int(x) for x in cu_seqlens_k.tolist())
    for name, bounds, rows in (
        ("cu_seqlens_q", q_bounds, q.shape[0]),
        ("cu_seqlens_k", k_bounds, k.shape[0]),
    ):
        if bounds[0] != 0 or bounds[-1] != rows:
            raise ValueError(
                f"{name} must start at 0 and end at the tensor's row count {rows}, got {bounds[0]} .. {bounds[-1]}"
            )
        if any(b < a for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"{name} must be non-decreasing, got {list(bounds)}")
        check_int32_rows(bounds[-1])  # non-decreasing from 0: the last offset is the largest
    longest_q = longest_k = 0
    for i in range(len(q_bounds) - 1):
        lq, lk = q_bounds[i + 1] - q_bounds[i], k_bounds[i + 1] - k_bounds[i]
        if lq > lk:
            raise ValueError(
                f"sequence {i}: {lq} queries but only {lk} keys; bottom-right causal attention needs at "
                "least as many keys as queries (queries are the last lq positions of their keys)"
            )
        longest_q, longest_k = max(longest_q, lq), max(longest_k, lk)
    if int(max_seqlen_q) < longest_q or int(max_seqlen_k) < longest_k:
        raise ValueError(
            f"max_seqlen_q/k ({max_seqlen_q}, {max_seqlen_k}) must be at least the longest sequence "
            f"({longest_q} queries, {longest_k} keys)"
        )
    if window is not None and (isinstance(window, bool) or int(window) != window or window < 1):
        raise ValueError(f"window must be a positive int (the sliding window) or None, got {window!r}")
    window = None if window is None else int(window)
    if softcap is not None and (isinstance(softcap, bool) or not math.isfinite(softcap) or softcap < 0):
        raise ValueError(f"softcap must be a positive finite number or None (0: none), got {softcap!r}")
    softcap = float(softcap) if softcap else None  # 0.0 means none, as in flash-attn
    return PackedSeqs(
        cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), q_bounds, k_bounds, window, softcap
    )


INT32_MAX = 2**31 - 1
"""The largest offset an int32 ``cu_seqlens`` holds: offsets count TOKENS (rows), never elements; element
offsets (rows x heads x head_dim, past 2**31 from 524288 rows of 32 x 128) are int64 everywhere."""


def int32_offsets(offsets: np.ndarray | torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Host cumulative row offsets (a NumPy array, a sequence or a CPU tensor) as a CPU int32 tensor,
    refusing offsets past :data:`INT32_MAX` rather than wrapping them as ``.to(torch.int32)`` and
    ``torch.as_tensor(int64 array, dtype=torch.int32)`` do silently."""
    t = offsets if isinstance(offsets, torch.Tensor) else torch.as_tensor(np.asarray(offsets, dtype=np.int64))
    if t.is_floating_point() or t.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be integers, got {t.dtype}")
    if t.dtype != torch.int32 and t.numel():
        check_int32_rows(int(t.max()), int(t.min()))
    return t.to(torch.int32)


def check_int32_rows(largest: int, smallest: int = 0) -> None:
    """Refuse row offsets an int32 ``cu_seqlens`` cannot hold (what the varlen kernels take)."""
    if largest > INT32_MAX or smallest < -INT32_MAX - 1:
        raise ValueError(
            f"cu_seqlens reach {largest if largest > INT32_MAX else smallest} rows, past what an int32 offset "
            f"holds ({INT32_MAX}: the varlen kernels take int32 row offsets); split the batch"
        )


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``, asynchronously for the host: a copy to CUDA goes through
    pinned memory, since a ``non_blocking`` copy from pageable memory is synchronous for the host anyway.

    The pinned source may be dropped at once: it comes from PyTorch's caching host allocator, which
    records the copy's stream on it and reuses the block only once the copy is done. Elsewhere (the CPU,
    or CUDA not available) an ordinary copy."""
    device = torch.device(device)
    if host.device == device:
        return host
    if device.type == "cuda" and host.device.type == "cpu":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def device_offsets(cu_seqlens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """cu_seqlens as int32 on ``device`` (a host tensor through :func:`host_to_device`: the copy does not
    wait for the device's queued work). The offsets are those :func:`check_inputs` validated (non-decreasing
    from 0 up to the row count, at most :data:`INT32_MAX`), so the conversion never wraps."""
    return host_to_device(cu_seqlens.to(torch.int32), device)


def check_backward_inputs(dout: torch.Tensor, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """The extra tensors of a backward call must match the forward's shapes."""
    if dout.shape != q.shape or out.shape != q.shape:
        raise ValueError(
            f"dout and out must be shaped like q {tuple(q.shape)}, got {tuple(dout.shape)} and {tuple(out.shape)}"
        )
    if lse.shape != q.shape[:2]:
        raise ValueError(f"lse must be shaped (Tq, Hq) = {tuple(q.shape[:2])}, got {tuple(lse.shape)}")


def check_sinks(sinks: torch.Tensor, q: torch.Tensor) -> None:
    """Attention sinks are one logit per query head, on q's device."""
    if sinks.shape != (q.shape[1],):
        raise ValueError(
            f"sinks must hold one logit per query head, shaped ({q.shape[1]},), got {tuple(sinks.shape)}"
        )
    if sinks.device != q.device:
        raise ValueError(f"sinks must be on q's device {q.device}, got {sinks.device}")
