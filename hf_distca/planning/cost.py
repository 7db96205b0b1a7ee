"""Cost models for CA-tasks: how expensive is computing queries [a, b) of a document against keys [0, b)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def causal_pairs(a: int, b: int) -> int:
    """Number of (query, key) pairs of causal attention for queries [a, b) over keys [0, b)."""
    return (b * (b + 1) - a * (a + 1)) // 2


class CausalFlopsCost:
    """Cost = causal (query, key) pairs. Multiply by 4 * heads * head_dim for forward FLOPs."""

    def task_cost(self, a: int, b: int) -> float:
        return float(causal_pairs(a, b))

    def __repr__(self) -> str:
        return "CausalFlopsCost()"


class MeasuredCost:
    """Cost from a measured (q_len, kv_len) -> seconds table, interpolated bilinearly.

    Captures what pure FLOPs miss: short shards run at lower kernel efficiency. Outside the table
    the nearest entry is scaled by the ratio of causal pairs.
    """

    def __init__(self, q_lens: Sequence[int], kv_lens: Sequence[int], seconds: Sequence[Sequence[float]]):
        self.q_lens = np.asarray(q_lens, dtype=np.float64)
        self.kv_lens = np.asarray(kv_lens, dtype=np.float64)
        self.seconds = np.asarray(seconds, dtype=np.float64)
        if self.seconds.shape != (len(self.q_lens), len(self.kv_lens)):
            raise ValueError(
                f"MeasuredCost: seconds must be shaped (len(q_lens), len(kv_lens)) = "
                f"({len(self.q_lens)}, {len(self.kv_lens)}), got {self.seconds.shape}"
            )
        if np.any(np.diff(self.q_lens) <= 0) or np.any(np.diff(self.kv_lens) <= 0):
            raise ValueError("MeasuredCost: q_lens and kv_lens must be strictly increasing")

    def task_cost(self, a: int, b: int) -> float:
        q_len, kv_len = b - a, b
        if q_len <= 0:
            return 0.0
        qc = float(np.clip(q_len, self.q_lens[0], self.q_lens[-1]))
        kc = float(np.clip(kv_len, self.kv_lens[0], self.kv_lens[-1]))
        per_kv = np.array([np.interp(kc, self.kv_lens, row) for row in self.seconds])
        t = float(np.interp(qc, self.q_lens, per_kv))
        if (qc, kc) != (q_len, kv_len):
            # scale by the pairs ratio between the asked shape and the clamped one
            ref_pairs = _shape_pairs(qc, kc)
            t *= _shape_pairs(q_len, kv_len) / max(ref_pairs, 1.0)
        return t

    def __repr__(self) -> str:
        return f"MeasuredCost({len(self.q_lens)}x{len(self.kv_lens)} table)"


def _shape_pairs(q_len: float, kv_len: float) -> float:
    a = kv_len - q_len
    return (kv_len * (kv_len + 1) - a * (a + 1)) / 2
