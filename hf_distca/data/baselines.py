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
  go, longest first, to the rank with the least estimated step cost (causal attention cost + linear
  per-token cost, counting at least the mean tokens per rank that every rank ends up with), and a
  document whose attention alone exceeds a rank's fair share is split head/tail over several ranks
  (per-document context parallelism). Exact when run through DistCA's engine with balancing off
  (``DistCAConfig(max_planner_moves=0)``): a tail piece gets its KV prefix from the ranks holding the head.
"""

from __future__ import annotations

from collections.abc import Sequence

from hf_distca.data.rebatch import LINEAR_PAIRS_PER_TOKEN, _lengths, layout_balanced, layout_pieces
from hf_distca.planning.pieces import Piece

balanced_layout = layout_balanced
"""WLB-LLM-style balanced packing: DistCA's own layout (:func:`~hf_distca.data.rebatch.layout_balanced`);
as a baseline it runs with the planner off (``DistCAConfig(max_planner_moves=0)``)."""

__all__ = ["LAYOUTS", "LINEAR_PAIRS_PER_TOKEN", "balanced_layout", "hf_default_layout"]


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


hf_default_layout.fills_budget = True  # type: ignore[attr-defined]
"""Transformers' packing fills rows of the budget: :class:`hf_distca.data.DistCABatches` lays this layout out
at ``tokens_per_rank`` whatever its ``pad_to_budget`` (a tighter row would cut other chunks)."""


LAYOUTS = {
    "distca": layout_balanced,
    "tokens": layout_pieces,
    "hf-default": hf_default_layout,
    "balanced": balanced_layout,
}
"""Layout name -> function (the recipe's ``--layout``): DistCA's default (cost-balanced packing), the
rebatcher's token-only placement (``tokens``: the exact-unbalanced baseline), and the two baselines
(``balanced`` is DistCA's layout run with the planner off)."""
