"""Which piece hands its state to which (pure Python): the chains of a layout and one rank's share of them.

A document cut into pieces over ranks is a chain: piece i (in document order) leaves a state that piece
i + 1 starts from. The edge i -> i + 1 is a hop from the rank holding piece i to the rank holding piece
i + 1; its position along the chain is i. With DistCA's zigzag layout a document over ranks r0..r(k-1)
is visited r0, r1, ..., r(k-1), ..., r1, r0, so chains are general rank sequences (a rank can hold two
pieces of one chain, and a hop can go to a lower rank); a layout with one contiguous chunk per rank gives
the plain chain 0 -> 1 -> ... -> P-1 of ZeCO / LASP. Documents held whole by one rank (or pieces that
start and end inside a rank) have no edge: the scan restarts at every document boundary.

Every rank derives the same plan from the same ``all_pieces``; nothing is exchanged to agree on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from hf_distca.planning.pieces import PieceError

__all__ = ["Edge", "ScanPlan", "build_scan_plan", "chains_of"]


@dataclass(frozen=True)
class Edge:
    """A state hand-off between consecutive pieces of one document."""

    chain: int
    """Document id of the chain."""
    position: int
    """Index of the edge along its chain (0: leaving the document's first piece)."""
    chain_edges: int
    """Number of edges of the whole chain (pieces - 1)."""
    src_rank: int
    src_slot: int
    """Index of the sending piece in ``ScanPlan.out_pieces`` of ``src_rank``."""
    dst_rank: int
    dst_slot: int
    """Index of the receiving piece in ``ScanPlan.in_pieces`` of ``dst_rank``."""


@dataclass(frozen=True)
class ScanPlan:
    """One rank's view of the state scan of a layout."""

    rank: int
    world_size: int
    out_pieces: tuple[int, ...]
    """Local indices (into this rank's pieces) of pieces whose final state continues on another piece."""
    out_runs: tuple[tuple[int, int], ...]
    """(local row start, length) of each out piece."""
    out_edges: tuple[Edge, ...]
    """The edge leaving each out piece."""
    in_pieces: tuple[int, ...]
    """Local indices of pieces that continue a document from an earlier piece."""
    in_runs: tuple[tuple[int, int], ...]
    in_edges: tuple[Edge, ...]
    """The edge entering each in piece."""
    out_input_slot: tuple[int, ...]
    """Per out piece: its slot in ``in_pieces`` when it also receives a state (a middle piece), else -1."""
    in_output_slot: tuple[int, ...]
    """Per in piece: its slot in ``out_pieces`` when it also sends a state on, else -1."""
    chains: tuple[tuple[Edge, ...], ...]
    """Every chain of the layout (all ranks), edges in order; identical on every rank."""
    out_counts: tuple[int, ...]
    """Out pieces per rank (all ranks)."""
    in_counts: tuple[int, ...]
    """In pieces per rank (all ranks)."""

    @property
    def max_chain_edges(self) -> int:
        """Edges of the longest chain over all ranks: the pipeline's depth."""
        return max((len(c) for c in self.chains), default=0)

    @property
    def has_edges(self) -> bool:
        """Whether any document of the layout is cut (the same answer on every rank)."""
        return bool(self.chains)


def document_runs(
    all_pieces: Sequence[Sequence[Sequence[int]]],
) -> dict[int, list[tuple[int, int, int, int, int]]]:
    """Per document, its non-empty pieces in document order as (doc_start, length, rank, local index,
    local row start). Raises PieceError when a piece is malformed, or a document's pieces overlap, leave a
    gap or do not start at 0."""
    by_doc: dict[int, list[tuple[int, int, int, int, int]]] = {}
    for rank, pieces in enumerate(all_pieces):
        offset = 0
        for index, raw in enumerate(pieces):
            if len(raw) != 3:
                raise PieceError(
                    f"rank {rank} piece {index} must be (doc_id, doc_start, length), got {raw!r}"
                )
            doc, start, length = (int(x) for x in raw)
            if length < 0 or start < 0:
                raise PieceError(f"rank {rank} piece {index} {tuple(raw)} has a negative start or length")
            if length > 0:
                by_doc.setdefault(doc, []).append((start, length, rank, index, offset))
            offset += length
    for doc, runs in by_doc.items():
        runs.sort()
        pos = 0
        for start, length, rank, index, _ in runs:
            if start != pos:
                raise PieceError(
                    f"document {doc}: piece (rank {rank}, index {index}) starts at {start} but the pieces before "
                    f"it end at {pos}; the pieces of every rank together must tile each document from 0"
                )
            pos += length
    return by_doc


def chains_of(all_pieces: Sequence[Sequence[Sequence[int]]]) -> list[list[tuple[int, int, int]]]:
    """Per cut document (sorted by id), its pieces in document order as (rank, local index, local row
    start). Raises PieceError as :func:`document_runs`."""
    by_doc = document_runs(all_pieces)
    return [
        [(rank, index, offset) for _, _, rank, index, offset in by_doc[doc]]
        for doc in sorted(by_doc)
        if len(by_doc[doc]) > 1
    ]


@lru_cache(maxsize=64)
def _build(all_pieces: tuple, rank: int) -> ScanPlan:
    world = len(all_pieces)
    chains = chains_of(all_pieces)
    lengths = {(r, i): int(p[2]) for r, pieces in enumerate(all_pieces) for i, p in enumerate(pieces)}
    # slots: per rank, out / in pieces in local piece order
    outs: list[list[int]] = [[] for _ in range(world)]
    ins: list[list[int]] = [[] for _ in range(world)]
    rows: dict[tuple[int, int], int] = {}
    for chain in chains:
        for i, (r, index, offset) in enumerate(chain):
            rows[(r, index)] = offset
            if i + 1 < len(chain):
                outs[r].append(index)
            if i > 0:
                ins[r].append(index)
    for lst in (*outs, *ins):
        lst.sort()
    out_slot = [{p: s for s, p in enumerate(lst)} for lst in outs]
    in_slot = [{p: s for s, p in enumerate(lst)} for lst in ins]
    all_edges: list[tuple[Edge, ...]] = []
    for chain in chains:
        doc = int(all_pieces[chain[0][0]][chain[0][1]][0])
        edges = []
        for i in range(len(chain) - 1):
            (sr, si, _), (dr, di, _) = chain[i], chain[i + 1]
            edges.append(Edge(doc, i, len(chain) - 1, sr, out_slot[sr][si], dr, in_slot[dr][di]))
        all_edges.append(tuple(edges))
    edge_out = {(e.src_rank, e.src_slot): e for c in all_edges for e in c}
    edge_in = {(e.dst_rank, e.dst_slot): e for c in all_edges for e in c}
    my_out, my_in = outs[rank], ins[rank]
    return ScanPlan(
        rank=rank,
        world_size=world,
        out_pieces=tuple(my_out),
        out_runs=tuple((rows[(rank, p)], lengths[(rank, p)]) for p in my_out),
        out_edges=tuple(edge_out[(rank, s)] for s in range(len(my_out))),
        in_pieces=tuple(my_in),
        in_runs=tuple((rows[(rank, p)], lengths[(rank, p)]) for p in my_in),
        in_edges=tuple(edge_in[(rank, s)] for s in range(len(my_in))),
        out_input_slot=tuple(in_slot[rank].get(p, -1) for p in my_out),
        in_output_slot=tuple(out_slot[rank].get(p, -1) for p in my_in),
        chains=tuple(all_edges),
        out_counts=tuple(len(x) for x in outs),
        in_counts=tuple(len(x) for x in ins),
    )


def build_scan_plan(all_pieces: Sequence[Sequence[Sequence[int]]], rank: int) -> ScanPlan:
    """The scan plan of ``rank`` for the layout ``all_pieces`` (index = rank; (doc_id, doc_start, length)).

    Cached: every layer of a micro-batch reuses the plan.
    """
    if not 0 <= rank < len(all_pieces):
        raise ValueError(f"rank {rank} is outside the layout's {len(all_pieces)} ranks")
    key = tuple(tuple(tuple(int(x) for x in p) for p in pieces) for pieces in all_pieces)
    return _build(key, rank)
