"""Pieces: which run of which document each rank holds, and the global index built from them.

A piece ``(doc_id, doc_start, length)`` says: this rank's next ``length`` local tokens are positions
``[doc_start, doc_start + length)`` of document ``doc_id``. Pieces of all ranks together must tile
every document exactly once, from position 0, with no gap and no overlap.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class Piece(NamedTuple):
    """A contiguous run of one document held by one rank."""

    doc_id: int
    doc_start: int
    length: int


class PieceError(ValueError):
    """Malformed pieces: overlaps, gaps or inconsistent lengths across ranks."""


@dataclass(frozen=True)
class Holding:
    """Where a run of a document lives: ``rank`` holds positions [doc_start, doc_start + length)
    of the document at local rows [local_start, local_start + length)."""

    doc_start: int
    length: int
    rank: int
    local_start: int

    @property
    def doc_end(self) -> int:
        return self.doc_start + self.length


class DocIndex:
    """Global view of all ranks' pieces: per document, its holdings sorted by position."""

    def __init__(self, pieces_per_rank: Sequence[Sequence[Sequence[int]]]):
        self.world_size = len(pieces_per_rank)
        self.tokens_per_rank: list[int] = []
        holdings: dict[int, list[Holding]] = {}
        for rank, pieces in enumerate(pieces_per_rank):
            offset = 0
            for raw in pieces:
                piece = _as_piece(raw, rank)
                if piece.length > 0:
                    holdings.setdefault(piece.doc_id, []).append(
                        Holding(piece.doc_start, piece.length, rank, offset)
                    )
                offset += piece.length
            self.tokens_per_rank.append(offset)
        self.doc_ids: list[int] = sorted(holdings)
        self.holdings: dict[int, list[Holding]] = {}
        self.doc_length: dict[int, int] = {}
        for doc_id in self.doc_ids:
            runs = sorted(holdings[doc_id], key=lambda h: (h.doc_start, h.rank))
            expected = 0
            for h in runs:
                if h.doc_start < expected:
                    raise PieceError(
                        f"document {doc_id}: positions [{h.doc_start}, {min(expected, h.doc_end)}) are held twice "
                        f"(overlap; one copy on rank {h.rank}); each token must belong to exactly one piece"
                    )
                if h.doc_start > expected:
                    raise PieceError(
                        f"document {doc_id}: positions [{expected}, {h.doc_start}) are held by no rank (gap); "
                        "pieces of a document must cover it from position 0 without holes"
                    )
                expected = h.doc_end
            self.holdings[doc_id] = runs
            self.doc_length[doc_id] = expected
        # per document, the end of each run in position order: segments() bisects to its first run
        self._run_ends: dict[int, list[int]] = {d: [h.doc_end for h in hs] for d, hs in self.holdings.items()}
        self._table = None  # segment_rows' run table, built on first use

    def segments(
        self, doc_id: int, start: int, end: int, rank: int | None = None
    ) -> list[tuple[int, int, int]]:
        """Split doc positions [start, end) into ``(rank, local_start, length)`` runs, in position order.

        With ``rank`` given, only the runs that rank holds (the others are skipped)."""
        out = []
        runs = self.holdings[doc_id]
        for i in range(bisect.bisect_right(self._run_ends[doc_id], start), len(runs)):
            h = runs[i]  # the first run ending after start, then on
            if h.doc_start >= end:
                break
            if rank is not None and h.rank != rank:
                continue
            lo, hi = max(start, h.doc_start), min(end, h.doc_end)
            out.append((h.rank, h.local_start + lo - h.doc_start, hi - lo))
        return out

    def segment_rows(
        self, doc_ids: Sequence[int], starts: Sequence[int], ends: Sequence[int]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`segments` of many ranges at once: ``(request, rank, rows)`` arrays, one entry per run
        that request i's doc positions [starts[i], ends[i]) of ``doc_ids[i]`` overlap, in request then
        position order (the same runs and rows as ``segments``, without the local offsets)."""
        position, run_start, run_end, run_rank, start_key, end_key, width = self._run_table()
        pos = np.fromiter((position[d] for d in doc_ids), dtype=np.int64, count=len(doc_ids))
        lo_at = np.asarray(starts, dtype=np.int64)
        hi_at = np.asarray(ends, dtype=np.int64)
        first = np.searchsorted(end_key, pos * width + lo_at, side="right")  # first run ending after start
        stop = np.searchsorted(start_key, pos * width + hi_at, side="left")  # first run starting at/after end
        count = np.maximum(stop - first, 0)
        request = np.repeat(np.arange(len(pos)), count)  # (S,)
        offset = np.cumsum(count) - count
        run = first[request] + np.arange(request.size) - offset[request]  # (S,)
        rows = np.minimum(run_end[run], hi_at[request]) - np.maximum(run_start[run], lo_at[request])
        return request, run_rank[run], rows

    def _run_table(self):
        """Every document's runs in one table (built once): document -> its position; per run its start,
        end and rank; and sort keys position x width + start / end (width: above every position), which
        keep the runs' order (by document, then position)."""
        if self._table is None:
            position = {d: i for i, d in enumerate(self.doc_ids)}
            runs = [
                (i, h.doc_start, h.doc_end, h.rank)
                for i, d in enumerate(self.doc_ids)
                for h in self.holdings[d]
            ]
            table = np.array(runs, dtype=np.int64).reshape(-1, 4)  # (R, 4): position, start, end, rank
            width = int(table[:, 2].max(initial=0)) + 1
            base = table[:, 0] * width
            self._table = (
                position,
                table[:, 1],
                table[:, 2],
                table[:, 3],
                base + table[:, 1],
                base + table[:, 2],
                width,
            )
        return self._table

    def count_held_by(self, doc_id: int, start: int, end: int, rank: int) -> int:
        """How many of doc positions [start, end) ``rank`` holds locally."""
        return sum(n for _, _, n in self.segments(doc_id, start, end, rank))


def _as_piece(raw: Sequence[int], rank: int) -> Piece:
    if len(raw) != 3:
        raise PieceError(f"rank {rank}: a piece is (doc_id, doc_start, length), got {tuple(raw)!r}")
    doc_id, doc_start, length = (int(x) for x in raw)
    if doc_id < 0 or doc_start < 0 or length < 0:
        raise PieceError(
            f"rank {rank}: piece {tuple(raw)!r} has a negative field; doc_id, doc_start and length must be >= 0"
        )
    return Piece(doc_id, doc_start, length)
