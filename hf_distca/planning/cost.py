"""Cost models for CA-tasks: how expensive is computing queries [a, b) of a document against their keys
([0, b), or [kv_start(a), b) under a sliding window: :mod:`hf_distca.planning.window`).

A cost model is any object with ``task_cost(a, b) -> float``; the planner only compares and adds
costs, so their unit is free. :func:`hf_distca.config.cost_model_from_config` picks the one a user config
asks for: :class:`CausalPairsCost` (``cost_table=None``, and ``"auto"`` on the CPU), :class:`MeasuredCost`
from the table of ``DistCAConfig.cost_table`` (written by ``python -m hf_distca.calibrate``) or, with
``"auto"`` on CUDA, the one the engine resolved (:mod:`hf_distca.cost_tables`,
:mod:`hf_distca.engine.cost_probe`); both take the layer's sliding window (``window``, None: full causal).
"""

from __future__ import annotations

import bisect
import copy
import hashlib
import json
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from hf_distca.planning.window import as_window, attended_pairs, kv_start

COST_TABLE_FORMAT = "hf_distca.cost_table/1"
TIMED = ("forward+backward", "forward")
"""What a table's cells time (its ``measured.timed`` field, written by ``python -m hf_distca.calibrate``)."""


def causal_pairs(a: int, b: int) -> int:
    """Number of (query, key) pairs of causal attention for queries [a, b) over keys [0, b)."""
    return (b * (b + 1) - a * (a + 1)) // 2


LINEAR_PAIRS_PER_TOKEN = 16384.0
"""Default weight of one token's non-attention cost, in causal (query, key) pairs: for a
Llama-3-8B-shaped layer on an H200, ~4 us of projections and MLP per token (forward, backward and
recompute) against ~0.25 ns of attention per pair (4.5 x 16384 FLOPs at ~300 TFLOP/s), the figures
behind benchmarks/simulate.py. The data path's estimates use it: :func:`hf_distca.data.rebatch.layout_balanced`
and :func:`hf_distca.data.nano.split_documents`."""


FWD_BWD_FLOP_RATIO = 3.5
"""Forward+backward over forward FLOPs of attention: forward 2 matmuls (4 FLOPs per pair and head
dimension), backward 5 (10)."""


def forward_flops_per_pair(q_heads: int, head_dim: int) -> float:
    """Forward FLOPs of one (query, key) pair: 4 x query heads x head_dim (QK^T and PV, 2 each)."""
    return 4.0 * q_heads * head_dim


def attention_flops_per_pair(q_heads: int, head_dim: int) -> float:
    """Forward+backward FLOPs of one (query, key) pair: the forward's x 3.5."""
    return forward_flops_per_pair(q_heads, head_dim) * FWD_BWD_FLOP_RATIO


class CausalPairsCost:
    """Cost of a task = its (query, key) pairs, :func:`~hf_distca.planning.window.attended_pairs` (causal
    pairs without a window); the default cost model.

    Proportional to the task's attention FLOPs (forward: 4 x heads x head_dim x pairs), which is what
    the kernel's time follows once shards are long (>= ~128 tokens)."""

    def __init__(self, window: int | None = None):
        self.window = as_window(window)

    def task_cost(self, a: int, b: int) -> float:
        """(query, key) pairs of queries [a, b) over their keys, as a float."""
        return float(attended_pairs(a, b, self.window))

    def with_window(self, window: int | None) -> CausalPairsCost:
        return self if as_window(window) == self.window else CausalPairsCost(window)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CausalPairsCost) and other.window == self.window

    def __hash__(self) -> int:
        return hash(("CausalPairsCost", self.window))

    def __repr__(self) -> str:
        return "CausalPairsCost()" if self.window is None else f"CausalPairsCost(window={self.window})"


def _kept(cache: dict, key: tuple, value: float) -> float:
    """``value``, stored in ``cache`` under ``key``; a cache at ``CACHE_SIZE`` entries is emptied first, so
    its memory stays bounded over a long run of different layouts."""
    if len(cache) >= CACHE_SIZE:
        cache.clear()
    cache[key] = value
    return value


class MeasuredCost:
    """Cost from a measured (q_len, kv_len) -> seconds table.

    Captures what pure FLOPs miss: short shards run at lower kernel efficiency. The table is turned
    into a rate (causal pairs per second) and the rate is interpolated bilinearly; a task costs its
    exact causal pairs divided by that rate. Entries with q_len > kv_len cannot be measured (a task's
    queries are a suffix of its KV prefix): they are ignored and take the rate of the same column's
    largest feasible q_len, so whole documents (q_len == kv_len) are priced from measured shapes only.
    Outside the grid the nearest rate is used. With a sliding ``window`` (:meth:`with_window`) a task
    costs its windowed pairs at the rate of its shape (q_len, keys it reads): the table measures full
    causal tasks, so this assumes a windowed kernel runs its pairs at the rate of a causal one of that
    shape.
    """

    window: int | None = None

    def __init__(
        self,
        q_lens: Sequence[int],
        kv_lens: Sequence[int],
        seconds: Sequence[Sequence[float]],
        timed: str = "forward+backward",
    ):
        if timed not in TIMED:
            raise ValueError(f"MeasuredCost: timed must be one of {TIMED}, got {timed!r}")
        self.timed = timed  # what each cell's seconds cover (the link model prices forward+backward)
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
        self.seconds = table
        # the grid as Python floats, and each row's slopes, for task_cost's scalar interpolation
        self._q, self._kv = self.q_lens.tolist(), self.kv_lens.tolist()
        self._rows = rate.tolist()
        self._row_slopes = [_slopes(self._kv, row) for row in self._rows]
        self._rates: dict[
            tuple[int, int], float
        ] = {}  # (q_len, kv_len) -> rate; shared by with_window copies
        self._costs: dict[tuple[int, int], float] = {}  # (a, b) -> task_cost(a, b) under this window

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> MeasuredCost:
        """Load a table written by ``python -m hf_distca.calibrate`` (see :func:`write_cost_table`)."""
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"cannot read the cost table {os.fspath(path)!r}: {err}") from err
        return cls.from_dict(data, os.fspath(path))

    @classmethod
    def from_dict(cls, data: Any, source: str) -> MeasuredCost:
        """The table of a parsed cost-table JSON object (``source`` names it in errors)."""
        if not isinstance(data, dict) or data.get("format") != COST_TABLE_FORMAT:
            raise ValueError(
                f"{source!r} is not a cost table (expected a JSON object with "
                f"format={COST_TABLE_FORMAT!r}); write one with python -m hf_distca.calibrate --out {source}"
            )
        missing = [k for k in ("q_lens", "kv_lens", "seconds") if k not in data]
        if missing:
            raise ValueError(f"cost table {source!r} lacks {missing}")
        seconds = [[math.nan if x is None else float(x) for x in row] for row in data["seconds"]]
        measured = data.get("measured") or {}
        try:
            return cls(data["q_lens"], data["kv_lens"], seconds, measured.get("timed", TIMED[0]))
        except ValueError as err:
            raise ValueError(f"cost table {source!r}: {err}") from err

    def digest(self) -> str:
        """sha256 of the grid and the measured times: equal tables give equal plans on every rank."""
        h = hashlib.sha256()
        for array in (self.q_lens, self.kv_lens, np.nan_to_num(self.seconds, nan=-1.0)):
            h.update(np.ascontiguousarray(array, dtype=np.float64).tobytes())
        if self.timed != TIMED[0]:
            h.update(self.timed.encode())
        return h.hexdigest()

    def with_window(self, window: int | None) -> MeasuredCost:
        """The same table pricing tasks of a layer with this sliding window (None: full causal)."""
        window = as_window(window)
        if window == self.window:
            return self
        other = copy.copy(self)
        other.window = window
        other._costs = {}
        return other

    def task_cost(self, a: int, b: int) -> float:
        """Seconds of queries [a, b) over their keys: the task's pairs over the interpolated rate of its
        shape (q_len, kv_len). Kept per (a, b), and the rate per shape (the planner asks again and again)."""
        cost = self._costs.get((a, b))
        if cost is None:
            cost = _kept(self._costs, (a, b), self._cost(a, b))
        return cost

    def _cost(self, a: int, b: int) -> float:
        q_len, kv_len = b - a, b - kv_start(a, self.window)
        if q_len <= 0:
            return 0.0
        rate = self._rates.get((q_len, kv_len))
        if rate is None:
            rate = _kept(self._rates, (q_len, kv_len), self._rate(q_len, kv_len))
        pairs = _shape_pairs(q_len, kv_len) if self.window is None else attended_pairs(a, b, self.window)
        return pairs / rate

    def _rate(self, q_len: int, kv_len: int) -> float:
        """Pairs per second of shape (q_len, kv_len): the table's rate interpolated bilinearly (each row
        along kv_len, then along q_len), clamped to the grid; the arithmetic of ``np.interp``, so equal
        to interpolating every row with it, for one task in pure Python."""
        q, kv = self._q, self._kv
        qc = min(max(float(q_len), q[0]), q[-1])
        kc = min(max(float(kv_len), kv[0]), kv[-1])
        i = bisect.bisect_right(q, qc) - 1  # q[i] <= qc < q[i + 1], or i the last row
        rows, slopes = self._rows, self._row_slopes
        lo = _interp(kc, kv, rows[i], slopes[i])
        if i == len(q) - 1 or q[i] == qc:
            return lo
        hi = _interp(kc, kv, rows[i + 1], slopes[i + 1])
        return _between(qc, q[i], q[i + 1], lo, hi, (hi - lo) / (q[i + 1] - q[i]))

    def __repr__(self) -> str:
        window = "" if self.window is None else f", window={self.window}"
        return (
            f"MeasuredCost({len(self.q_lens)}x{len(self.kv_lens)} table, sha256={self.digest()[:16]}{window})"
        )


CACHE_SIZE = 1 << 17
"""Entries a :class:`MeasuredCost` keeps of task costs and of shape rates, each (cleared when full)."""


def _slopes(xp: list[float], fp: list[float]) -> list[float]:
    """Per grid interval, the slope ``np.interp`` uses: (fp[j + 1] - fp[j]) / (xp[j + 1] - xp[j])."""
    return [(fp[j + 1] - fp[j]) / (xp[j + 1] - xp[j]) for j in range(len(xp) - 1)]


def _interp(x: float, xp: list[float], fp: list[float], slopes: list[float]) -> float:
    """``np.interp(x, xp, fp)`` for xp[0] <= x <= xp[-1], with its arithmetic (bit for bit)."""
    j = bisect.bisect_right(xp, x) - 1  # xp[j] <= x < xp[j + 1], or j the last point
    if j == len(xp) - 1 or xp[j] == x:
        return fp[j]
    return _between(x, xp[j], xp[j + 1], fp[j], fp[j + 1], slopes[j])


def _between(x: float, x0: float, x1: float, y0: float, y1: float, slope: float) -> float:
    """np.interp's value strictly inside [x0, x1): from the left point, else (NaN) from the right one."""
    y = slope * (x - x0) + y0
    if y != y:
        y = slope * (x - x1) + y1
        if y != y and y0 == y1:
            y = y0
    return y


def _shape_pairs(q_len: float, kv_len: float) -> float:
    a = kv_len - q_len
    return (kv_len * (kv_len + 1) - a * (a + 1)) / 2


def write_cost_table(
    path: str | os.PathLike,
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    seconds: Sequence[Sequence[float | None]],
    measured: dict[str, Any] | None = None,
) -> None:
    """Write a table :meth:`MeasuredCost.from_json` reads: ``seconds[i][j]`` is the time of one task of
    ``q_lens[i]`` queries over ``kv_lens[j]`` keys, None where q_len > kv_len (no such task);
    ``measured`` records how (device, dtype, heads, ...)."""
    MeasuredCost(
        q_lens, kv_lens, [[math.nan if x is None else x for x in row] for row in seconds]
    )  # validate
    data = {
        "format": COST_TABLE_FORMAT,
        "q_lens": [int(q) for q in q_lens],
        "kv_lens": [int(kv) for kv in kv_lens],
        "seconds": [[None if x is None else float(x) for x in row] for row in seconds],
        "measured": measured or {},
    }
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
