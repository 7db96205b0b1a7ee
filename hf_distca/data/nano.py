"""Nano-batches of a micro-batch for layer-level ping-pong: its documents in groups of equal tokens.

Each nano-batch is a micro-batch of its own (its own layout over the ranks, its own plan), so it can run
through the model on its own and the two interleave (:mod:`hf_distca.engine.interleave`). Documents stay
whole: attention never crosses nano-batches, so the results equal those of the micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence

NANO_BATCHES = "distca_nano_batches"
"""The micro-batch key holding its nano-batches (a tuple of model-input dicts)."""


def split_documents(lengths: Sequence[int], parts: int = 2) -> list[list[int]] | None:
    """Indices of the documents of each nano-batch: longest first, each to the nano-batch with the fewest
    tokens so far (ties: the lower index), indices ascending inside each. None when fewer documents than
    ``parts`` (a nano-batch would be empty): the micro-batch then runs whole."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if len(lengths) < parts:
        return None
    groups: list[list[int]] = [[] for _ in range(parts)]
    tokens = [0] * parts
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        j = min(range(parts), key=lambda j: (tokens[j], j))
        groups[j].append(i)
        tokens[j] += lengths[i]
    return [sorted(g) for g in groups]
