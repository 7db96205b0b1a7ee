"""Baseline layouts of a global micro-batch: what users run instead of DistCA, for benchmarks.

Each function is a :data:`~hf_distca.data.rebatch.LayoutFn`, like the rebatcher's
:func:`~hf_distca.data.rebatch.layout_pieces`: from the lengths of one global micro-batch's documents
(in dataset order) it returns every rank's pieces ``(doc_id, doc_start, length)``, each rank holding
exactly ``tokens_per_rank`` tokens (the remainder is rank r's padding pseudo-document
``len(doc_lengths) + r``). So every system trains the same documents per step with the same memory
budget per rank; only where the tokens go (and, for the HF default, which attention is computed)
differs. Pure functions, no processes.

- :func:`hf_default_layout`: data parallel as Hugging Face users run it (``DataCollatorWithFlattening``
  over a token budget): each rank packs whole documents in dataset order until the next one does not
  fit. A document longer than the budget becomes independent chunks of ``tokens_per_rank`` tokens; run
  it with attention local to each piece (``DistCACallback(disaggregate=False)``), so a chunk does not
  see the chunks before it: **the math differs** from the whole document's.
- :func:`balanced_layout`: balanced packing in the style of WLB-LLM (Wang et al., OSDI 2025): documents
  go, most expensive first, to the rank with the least estimated step cost (linear per-token cost +
  causal attention cost), and a document whose attention alone exceeds a rank's fair share is split
  head/tail over several ranks (per-document context parallelism). Exact when run through DistCA's
  engine with balancing off (``DistCAConfig(max_planner_moves=0)``): a tail piece gets its KV prefix
  from the ranks holding the head.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hf_distca.data.rebatch import _check_positive, _merge_adjacent, _water_fill, _zigzag, layout_pieces
from hf_distca.planning.cost import causal_pairs
from hf_distca.planning.pieces import Piece

__all__ = ["LAYOUTS", "LINEAR_PAIRS_PER_TOKEN", "balanced_layout", "hf_default_layout"]

LINEAR_PAIRS_PER_TOKEN = 16384.0
"""Default weight of one token's non-attention cost, in causal (query, key) pairs: for a
Llama-3-8B-shaped layer on an H200, ~4 us of projections and MLP per token (forward, backward and
recompute) against ~0.25 ns of attention per pair (4.5 x 16384 FLOPs at ~300 TFLOP/s), the figures
behind benchmarks/simulate.py. Only :func:`balanced_layout`'s estimate uses it."""


def _lengths(doc_lengths: Sequence[int], world_size: int, tokens_per_rank: int) -> list[int]:
    _check_positive("world_size", world_size)
    _check_positive("tokens_per_rank", tokens_per_rank)
    lengths = [int(n) for n in doc_lengths]
    if any(n < 0 for n in lengths):
        raise ValueError(f"document lengths must be >= 0, got {lengths}")
    if sum(lengths) > world_size * tokens_per_rank:
        raise ValueError(
            f"{len(lengths)} documents hold {sum(lengths)} tokens, more than world_size x tokens_per_rank = "
            f"{world_size} x {tokens_per_rank}; plan smaller micro-batches (plan_global_batches)"
        )
    return lengths


def _finish(placed: list[list[Piece]], free: list[int], num_docs: int) -> list[tuple[Piece, ...]]:
    """Merge touching pieces of one document and pad every rank to its budget."""
    out = []
    for rank, pieces in enumerate(placed):
        pieces = _merge_adjacent(pieces)
        if free[rank]:
            pieces.append(Piece(num_docs + rank, 0, free[rank]))
        out.append(tuple(pieces))
    return out


def hf_default_layout(
    doc_lengths: Sequence[int], *, world_size: int, tokens_per_rank: int, min_piece_tokens: int = 1
) -> list[tuple[Piece, ...]]:
    """Data-parallel packing in dataset order (``min_piece_tokens`` is accepted and unused).

    Rank 0 takes documents in order while they fit, then rank 1, and so on: a document that does
    not fit in the current rank's remaining space starts the next rank. A document longer than
    ``tokens_per_rank`` is cut into chunks of ``tokens_per_rank`` tokens (the last one shorter),
    each placed the same way. Chunks that find no rank left (the last documents of a micro-batch
    that the sequential packing could not fit) fill the ranks' remaining space in rank order, cut
    where a rank is full; a real data-parallel run would carry them to its next step instead, with
    padding here. Pieces of one document stay separate sequences: with attention local to each
    piece (``disaggregate=False``) they are independent chunks.
    """
    lengths = _lengths(doc_lengths, world_size, tokens_per_rank)
    placed: list[list[Piece]] = [[] for _ in range(world_size)]
    free = [tokens_per_rank] * world_size
    rank = 0
    left: list[tuple[int, int, int]] = []  # (doc, doc_start, length) that found no rank in order
    for doc, length in enumerate(lengths):
        for start in range(0, length, tokens_per_rank):
            n = min(tokens_per_rank, length - start)
            while rank < world_size and free[rank] < n:
                rank += 1  # the current rank is full for this chunk: packing moves on
            if rank == world_size:
                left.append((doc, start, n))
                continue
            placed[rank].append(Piece(doc, start, n))
            free[rank] -= n
    gap = 0
    for doc, start, n in left:
        while n:
            while free[gap] == 0:
                gap += 1
            take = min(n, free[gap])
            placed[gap].append(Piece(doc, start, take))
            free[gap] -= take
            start, n = start + take, n - take
    out = []
    for r, pieces in enumerate(placed):  # no merging: every piece is its own sequence
        out.append(tuple(pieces) + ((Piece(len(lengths) + r, 0, free[r]),) if free[r] else ()))
    return out


def balanced_layout(
    doc_lengths: Sequence[int],
    *,
    world_size: int,
    tokens_per_rank: int,
    min_piece_tokens: int = 1,
    linear_pairs_per_token: float = LINEAR_PAIRS_PER_TOKEN,
) -> list[tuple[Piece, ...]]:
    """Balanced packing with per-document context parallelism (WLB-LLM style).

    Estimated cost of a piece ``[a, b)`` of a document: ``linear_pairs_per_token x (b - a)`` plus its
    causal (query, key) pairs with full context, ``causal_pairs(a, b)``. Documents are taken by
    decreasing cost (ties: lower index first).

    - A document is split over ``k = max(ceil(length / tokens_per_rank), ceil(pairs / fair))`` ranks
      (at most ``world_size``), ``fair`` being the micro-batch's attention pairs over ``world_size``:
      a document whose attention alone exceeds one rank's fair share is cut. The ``k`` ranks with the
      least estimated cost that have room take shares as equal as their room allows, each share a
      head and a tail of the document laid out ``head_0 .. head_{k-1} tail_{k-1} .. tail_0`` (equal
      causal work per rank for equal shares); more ranks join when those ``k`` lack the room.
    - Any other document goes whole to the rank with the least estimated cost among those with room
      for it (ties: most room, then lower rank); when none has room it is split as above over two or
      more ranks.

    Ranks hold at most ``tokens_per_rank`` tokens, the memory budget every system gets; the global
    micro-batch nearly fills it, so the balance comes from which documents go where and from the
    splits, not from unequal token counts.
    """
    lengths = _lengths(doc_lengths, world_size, tokens_per_rank)
    _check_positive("min_piece_tokens", min_piece_tokens)
    if not linear_pairs_per_token >= 0:
        raise ValueError(f"linear_pairs_per_token must be >= 0, got {linear_pairs_per_token!r}")

    def cost(a: int, b: int) -> float:
        return linear_pairs_per_token * (b - a) + causal_pairs(a, b)

    fair = sum(causal_pairs(0, n) for n in lengths) / world_size
    placed: list[list[Piece]] = [[] for _ in range(world_size)]
    free = [tokens_per_rank] * world_size
    load = [0.0] * world_size
    for doc in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[doc]
        if length == 0:
            continue
        # fair > 0: this document has attention pairs
        k = max(math.ceil(length / tokens_per_rank), math.ceil(causal_pairs(0, length) / fair))
        k = min(k, world_size)
        if k == 1:
            fits = [r for r in range(world_size) if free[r] >= length]
            if fits:
                rank = min(fits, key=lambda r: (load[r], -free[r], r))
                placed[rank].append(Piece(doc, 0, length))
                free[rank] -= length
                load[rank] += cost(0, length)
                continue
            k = 2  # no rank has room for it whole
        by_load = sorted((r for r in range(world_size) if free[r] > 0), key=lambda r: (load[r], -free[r], r))
        ranks = by_load[:k]
        for r in by_load[k:]:
            if sum(free[x] for x in ranks) >= length:
                break
            ranks.append(r)
        shares = _water_fill([free[r] for r in ranks], length)
        for rank, doc_start, n in _zigzag(ranks, shares, min_piece_tokens):
            placed[rank].append(Piece(doc, doc_start, n))
            free[rank] -= n
            load[rank] += cost(doc_start, doc_start + n)
    return _finish(placed, free, len(lengths))


LAYOUTS = {"distca": layout_pieces, "hf-default": hf_default_layout, "balanced": balanced_layout}
"""Layout name -> function (the recipe's ``--layout``): the rebatcher and the two baselines."""
