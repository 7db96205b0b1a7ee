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
    """Cost from a measured (q_len, kv_len) -> seconds table.

    Captures what pure FLOPs miss: short shards run at lower kernel efficiency. The table is turned
    into a rate (causal pairs per second) and the rate is interpolated bilinearly; a task costs its
    exact causal pairs divided by that rate. Entries with q_len > kv_len cannot be measured (a task's
    queries are a suffix of its KV prefix): they are ignored and take the rate of the same column's
    largest feasible q_len, so whole documents (q_len == kv_len) are priced from measured shapes only.
    Outside the grid the nearest rate is used.
    """

    def __init__(self, q_lens: Sequence[int], kv_lens: Sequence[int], seconds: Sequence[Sequence[float]]):
        self.q_lens = np.asarray(q_lens, dtype=np.float64)
        self.kv_lens = np.asarray(kv_lens, dtype=np.float64)
        table = np.asarray(seconds, dtype=np.float64)
        if table.shape != (len(self.q_lens), len(self.kv_lens)):
            raise ValueError(
                f"MeasuredCost: seconds must be shaped (len(q_lens), len(kv_lens)) = "
                f"({len(self.q_lens)}, {len(self.kv_lens)}), got {table.shape}"
            )
        if np.any(np.diff(self.q_lens) <= 0) or np.any(np.diff(self.kv_lens) <= 0):
            raise ValueError("MeasuredCost: q_lens and kv_lens must be strictly increasing")
        if self.q_lens[0] < 1:
            raise ValueError("MeasuredCost: q_lens must be >= 1")
        feasible = self.q_lens[:, None] <= self.kv_lens[None, :]  # (Q, K)
        if not feasible.any():
            raise ValueError("MeasuredCost: no table entry has q_len <= kv_len; measure CA-task shapes")
        bad = feasible & ~(table > 0)
        if bad.any():
            i, j = np.argwhere(bad)[0]
            raise ValueError(
                f"MeasuredCost: seconds[{i}][{j}] (q_len={q_lens[i]}, kv_len={kv_lens[j]}) must be a positive time"
            )
        pairs = np.vectorize(_shape_pairs)(self.q_lens[:, None], self.kv_lens[None, :])  # (Q, K)
        rate = np.where(feasible, pairs / np.where(feasible, table, 1.0), np.nan)  # pairs per second
        for j in range(rate.shape[1]):
            rows = np.flatnonzero(feasible[:, j])
            if rows.size:
                rate[rows[-1] + 1 :, j] = rate[rows[-1], j]
        # columns with kv_len below every q_len: copy the nearest column to the right that has data
        for j in range(rate.shape[1] - 1, -1, -1):
            if np.isnan(rate[:, j]).all():
                rate[:, j] = rate[:, j + 1]
        self.rate = rate

    def task_cost(self, a: int, b: int) -> float:
        q_len, kv_len = b - a, b
        if q_len <= 0:
            return 0.0
        qc = float(np.clip(q_len, self.q_lens[0], self.q_lens[-1]))
        kc = float(np.clip(kv_len, self.kv_lens[0], self.kv_lens[-1]))
        per_q = np.array([np.interp(kc, self.kv_lens, row) for row in self.rate])  # (Q,)
        rate = float(np.interp(qc, self.q_lens, per_q))
        return _shape_pairs(q_len, kv_len) / rate

    def __repr__(self) -> str:
        return f"MeasuredCost({len(self.q_lens)}x{len(self.kv_lens)} table)"


def _shape_pairs(q_len: float, kv_len: float) -> float:
    a = kv_len - q_len
    return (kv_len * (kv_len + 1) - a * (a + 1)) / 2
