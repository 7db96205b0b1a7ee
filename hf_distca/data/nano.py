"""Nano-batches of a micro-batch for layer-level ping-pong: its documents in groups of about equal cost.

Each nano-batch is a micro-batch of its own (its own layout over the ranks, its own plan), so it can run
through the model on its own and the two interleave (:mod:`hf_distca.engine.interleave`), each at its
own tokens per rank (no padding to the larger one). Documents stay whole: attention never crosses
nano-batches, so the results equal those of the micro-batch. The one split and the one padding rule of
both the data path (:class:`hf_distca.data.DistCABatches`) and the simulator (benchmarks/simulate.py);
no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from hf_distca.planning.cost import LINEAR_PAIRS_PER_TOKEN, causal_pairs

NANO_BATCHES = "distca_nano_batches"
"""The micro-batch key holding its nano-batches (a tuple of model-input dicts)."""


def split_documents(lengths: Sequence[int], parts: int = 2) -> list[list[int]] | None:
    """Indices of the documents of each nano-batch, groups of about equal estimated cost (per document,
    ``LINEAR_PAIRS_PER_TOKEN`` per token plus its causal pairs), so that the nano-batches' projections and
    attention both about match and each hides the other's exchanges: most expensive first, each to the
    cheapest group so far (ties: the fewer tokens, then the lower group), indices ascending inside each. None when fewer documents than
    ``parts`` (a nano-batch would be empty): the micro-batch then runs whole."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if len(lengths) < parts:
        return None
    cost = [LINEAR_PAIRS_PER_TOKEN * n + causal_pairs(0, int(n)) for n in lengths]
    groups: list[list[int]] = [[] for _ in range(parts)]
    load, tokens = [0.0] * parts, [0] * parts
    for i in sorted(range(len(lengths)), key=lambda i: (-cost[i], i)):
        j = min(range(parts), key=lambda j: (load[j], tokens[j], j))
        groups[j].append(i)
        load[j] += cost[i]
        tokens[j] += int(lengths[i])
    return [sorted(g) for g in groups]


def whole_tokens_per_rank(
    doc_lengths: Sequence[int],
    world: int,
    tokens_per_rank: int,
    pad_to_budget: bool,
    layout: Callable[..., Any] | None = None,
) -> int:
    """Tokens per rank of a micro-batch of documents of ``doc_lengths`` that runs whole (not in
    nano-batches): ``tokens_per_rank`` (the budget) with ``pad_to_budget`` or a ``layout`` that fills its
    budget (a ``fills_budget`` attribute: Transformers' packing, ``hf_default_layout``), else the fewest
    that hold them, as a nano-batch (:func:`nano_tokens_per_rank`). The data path's rule
    (``DistCABatches``) and the simulator's."""
    if pad_to_budget or getattr(layout, "fills_budget", False):
        return tokens_per_rank
    return nano_tokens_per_rank([[int(n) for n in doc_lengths]], world)[0]


def nano_tokens_per_rank(group_lengths: Sequence[Sequence[int]], world: int) -> list[int]:
    """Tokens per rank of each nano-batch: the fewest its layout accepts, ``ceil(its tokens / world)``, so
    that a nano-batch carries at most ``world - 1`` padding tokens and the nano-batches of a micro-batch
    together hold at most ``world - 1`` per nano-batch more than its documents. Every layout of
    :mod:`hf_distca.data.rebatch` accepts any budget with ``world x tokens_per_rank >= the tokens`` (a
    document cut where it must be); no multiple of ``DistCAConfig.shard_tokens`` is needed (the planner's
    cuts fall on multiples of it inside documents, wherever a rank's share ends). The nano-batches of one
    micro-batch therefore differ in shape (one long document alone in a nano-batch holds more tokens than
    the many short ones of the other): each runs through the model as a micro-batch of its own.
    ``group_lengths``: the document lengths of each nano-batch."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    return [max(1, math.ceil(sum(int(n) for n in g) / world)) for g in group_lengths]
