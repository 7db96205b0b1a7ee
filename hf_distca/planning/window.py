"""The sliding window's effect on CA-tasks: the one place that says which keys a query shard reads and
how many (query, key) pairs it computes.

Transformers' sliding window (``masking_utils.sliding_window_causal_mask_function``) lets query i see
key j when ``0 <= i - j < window``. A CA-task of queries [a, b) therefore reads keys
[:func:`kv_start` (a), b) (the whole prefix [0, b) without a window) and computes
:func:`attended_pairs` (a, b) pairs: min(i + 1, window) per query. The planner's cost and traffic, the
dispatch index, the engine's FLOP counters and benchmarks/simulate.py all read these functions.
``window`` None means full causal attention.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

Ranges = list[tuple[int, int]]
"""Sorted, disjoint, non-touching [lo, hi) position ranges of one document."""


def as_window(window: int | None) -> int | None:
    """``window`` as an int (None stays None); raises for a window below 1."""
    if window is None:
        return None
    if isinstance(window, bool) or int(window) != window or window < 1:
        raise ValueError(f"sliding window must be a positive int or None, got {window!r}")
    return int(window)


def kv_start(a: int, window: int | None) -> int:
    """First key position query position ``a`` sees (and so the first key of a task starting at a)."""
    return 0 if window is None else max(0, a - window + 1)


def attended_pairs(a: int, b: int, window: int | None = None) -> int:
    """(query, key) pairs of queries [a, b) over their keys: sum of min(i + 1, window) over i in [a, b)."""
    if b <= a:
        return 0
    if window is None or b <= window:
        return (b * (b + 1) - a * (a + 1)) // 2
    c = min(max(a, window), b)  # queries from c on see exactly `window` keys
    return (c * (c + 1) - a * (a + 1)) // 2 + window * (b - c)


def kv_ranges(intervals: Iterable[Sequence[int]], window: int | None) -> Ranges:
    """The keys read by query intervals [a, b) of one document (sorted by a): the union of
    [kv_start(a), b), as sorted disjoint ranges (touching ranges merged)."""
    out: Ranges = []
    for a, b in intervals:
        lo = kv_start(a, window)
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((lo, b))
    return out


def ranges_minus(ranges: Ranges, minus: Ranges) -> Ranges:
    """Positions of ``ranges`` not in ``minus`` (both sorted, disjoint)."""
    out: Ranges = []
    j = 0
    for lo, hi in ranges:
        while j < len(minus) and minus[j][1] <= lo:
            j += 1
        k, cur = j, lo
        while k < len(minus) and minus[k][0] < hi:
            if minus[k][0] > cur:
                out.append((cur, minus[k][0]))
            cur = max(cur, minus[k][1])
            k += 1
        if cur < hi:
            out.append((cur, hi))
    return out


def ranges_union(a: Ranges, b: Ranges) -> Ranges:
    """Union of two sorted disjoint range lists."""
    out: Ranges = []
    for lo, hi in sorted([*a, *b]):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def ranges_length(ranges: Ranges) -> int:
    return sum(hi - lo for lo, hi in ranges)
