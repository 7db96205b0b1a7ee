"""Pieces: which run of which document each rank holds, and the global index built from them.

A piece ``(doc_id, doc_start, length)`` says: this rank's next ``length`` local tokens are positions
``[doc_start, doc_start + length)`` of document ``doc_id``. Pieces of all ranks together must tile
every document exactly once, from position 0, with no gap and no overlap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


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

    def segments(
        self, doc_id: int, start: int, end: int, rank: int | None = None
    ) -> list[tuple[int, int, int]]:
        """Split doc positions [start, end) into ``(rank, local_start, length)`` runs, in position order.

        With ``rank`` given, only the runs that rank holds (the others are skipped)."""
        out = []
        for h in self.holdings[doc_id]:
            if h.doc_end <= start:
                continue
            if h.doc_start >= end:
                break
            if rank is not None and h.rank != rank:
                continue
            lo, hi = max(start, h.doc_start), min(end, h.doc_end)
            out.append((h.rank, h.local_start + lo - h.doc_start, hi - lo))
        return out

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
