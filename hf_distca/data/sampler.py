"""plan_global_batches: which documents form each optimizer step and each of its micro-batches.

DistCA keeps data-parallel semantics but not data-parallel sharding: every rank sees the same global
micro-batch and the rebatcher (``rebatch.py``) lays it out over the ranks. So the plan here is the
same on every rank and depends only on the document lengths, the token budgets, the seed and the
epoch; never on the world size. ``tokens_per_rank = 2T`` on one rank and ``T`` on two ranks therefore
train on identical batches (same tokens, same steps), which is what makes runs comparable.

Packing: document indices are shuffled with ``numpy.random.Generator(PCG64(seed + epoch))``, then
consumed in that order. Each step has ``micro_batches`` micro-batches ("bins") of
``tokens_per_step // micro_batches`` tokens; a document goes to the first bin of the current step
with room for it (first-fit), and the first document that fits in none of them closes the step and
opens the next one. A step is thus a contiguous run of the shuffled order (only the bin inside the
step depends on the packing), and the loss, token-weighted over the whole step, does not care which
micro-batch a document landed in.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["GlobalBatchPlan", "plan_global_batches"]


class GlobalBatchPlan(list):
    """Steps -> micro-batches -> document indices, plus what the planner had to change.

    It *is* the list of steps (index it, iterate it, compare it to a list); the attributes record
    every document that was not used as-is, so nothing is changed silently.
    """

    micro_batch_tokens: int
    """Token budget of one micro-batch (= tokens_per_rank x world_size). Documents longer than this
    must be cut to their first ``micro_batch_tokens`` tokens before layout (see ``truncated``)."""
    truncated: tuple[int, ...]
    """Indices of documents longer than ``micro_batch_tokens``; the plan counts only their first
    ``micro_batch_tokens`` tokens and the caller must truncate them to that."""
    skipped: tuple[int, ...]
    """Indices of documents shorter than 2 tokens: they hold no next-token target, so they are left out."""
    dropped: tuple[int, ...]
    """Indices of documents of the incomplete last step, left out because ``drop_last=True``."""
    planned_tokens: int
    """Tokens (after truncation) in all planned micro-batches."""

    def __init__(
        self,
        steps: list[list[list[int]]],
        *,
        micro_batch_tokens: int,
        truncated: Sequence[int],
        skipped: Sequence[int],
        dropped: Sequence[int],
        planned_tokens: int,
    ):
        super().__init__(steps)
        self.micro_batch_tokens = micro_batch_tokens
        self.truncated = tuple(truncated)
        self.skipped = tuple(skipped)
        self.dropped = tuple(dropped)
        self.planned_tokens = planned_tokens

    @property
    def steps(self) -> list[list[list[int]]]:
        """The plan as a plain list: steps -> micro-batches -> document indices."""
        return list(self)

    @property
    def num_micro_batches(self) -> int:
        return sum(len(step) for step in self)

    @property
    def fill_fraction(self) -> float:
        """Planned tokens over the capacity of all planned micro-batches (1 - padding share)."""
        capacity = self.num_micro_batches * self.micro_batch_tokens
        return self.planned_tokens / capacity if capacity else 0.0

    def __repr__(self) -> str:
        return (
            f"GlobalBatchPlan(steps={len(self)}, micro_batches={self.num_micro_batches}, "
            f"micro_batch_tokens={self.micro_batch_tokens}, fill={self.fill_fraction:.3f}, "
            f"truncated={len(self.truncated)}, skipped={len(self.skipped)}, dropped={len(self.dropped)})"
        )


def plan_global_batches(
    doc_lengths: Sequence[int],
    *,
    tokens_per_step: int,
    micro_batches: int,
    seed: int,
    epoch: int = 0,
    drop_last: bool = True,
) -> GlobalBatchPlan:
    """Shuffle the documents and pack them into optimizer steps of ``micro_batches`` micro-batches.

    Args:
        doc_lengths: token count of every document of the dataset (index = document index).
        tokens_per_step: token budget of one optimizer step over all ranks; each micro-batch gets
            ``tokens_per_step // micro_batches`` (= tokens_per_rank x world_size).
        micro_batches: micro-batches per optimizer step (gradient accumulation steps).
        seed, epoch: the shuffle uses ``numpy.random.Generator(PCG64(seed + epoch))``.
        drop_last: drop the last step when it has fewer than ``micro_batches`` micro-batches (its
            documents are listed in ``dropped``); with False it is kept, shorter.

    Returns:
        A ``GlobalBatchPlan``: the list of steps, each a list of micro-batches, each a list of
        document indices; plus the truncated / skipped / dropped documents.
    """
    _check_int("tokens_per_step", tokens_per_step, 1)
    _check_int("micro_batches", micro_batches, 1)
    _check_int("seed", seed, 0)
    _check_int("epoch", epoch, 0)
    lengths = np.asarray(doc_lengths, dtype=np.int64)
    if lengths.ndim != 1 or lengths.size == 0:
        raise ValueError(
            f"plan_global_batches needs a non-empty 1-D sequence of document lengths, got shape {lengths.shape}; "
            "check that the dataset is not empty"
        )
    if lengths.min() < 0:
        bad = int(np.flatnonzero(lengths < 0)[0])
        raise ValueError(f"document {bad} has negative length {int(lengths[bad])}; lengths must be >= 0")
    budget = tokens_per_step // micro_batches
    if budget < 2:
        raise ValueError(
            f"micro-batch budget tokens_per_step // micro_batches = {tokens_per_step} // {micro_batches} = {budget} "
            "leaves no room for a next-token target; raise tokens_per_step or lower micro_batches"
        )

    order = np.random.Generator(np.random.PCG64(seed + epoch)).permutation(lengths.size)
    sizes = np.minimum(lengths, budget)
    skipped = sorted(int(i) for i in np.flatnonzero(lengths < 2))
    truncated = sorted(int(i) for i in np.flatnonzero(lengths > budget))
    if len(skipped) == lengths.size:
        raise ValueError(
            f"all {lengths.size} documents are shorter than 2 tokens and hold no next-token target; "
            "check the tokenization of the dataset"
        )

    steps: list[list[list[int]]] = []
    bins: list[list[int]] = []
    free: list[int] = []
    for idx in order.tolist():
        size = int(sizes[idx])
        if size < 2:
            continue
        slot = next((b for b, room in enumerate(free) if room >= size), None)
        if slot is None and len(bins) < micro_batches:
            bins.append([])
            free.append(budget)
            slot = len(bins) - 1
        if slot is None:  # fits in no micro-batch of this step: the step is complete
            steps.append(bins)
            bins, free, slot = [[]], [budget], 0
        bins[slot].append(idx)
        free[slot] -= size

    dropped: list[int] = []
    if bins:
        if len(bins) == micro_batches or not drop_last:
            steps.append(bins)
        else:
            dropped = sorted(i for mb in bins for i in mb)
    if not steps:
        raise ValueError(
            f"the dataset fills only {len(bins)} of the {micro_batches} micro-batches of one step "
            f"({int(sizes[sizes >= 2].sum())} tokens for a step of {micro_batches} x {budget}); "
            "lower tokens_per_step or micro_batches, add documents, or pass drop_last=False"
        )

    planned = int(sum(int(sizes[i]) for step in steps for mb in step for i in mb))
    plan = GlobalBatchPlan(
        steps,
        micro_batch_tokens=budget,
        truncated=truncated,
        skipped=skipped,
        dropped=dropped,
        planned_tokens=planned,
    )
    if truncated:
        logger.warning(
            "plan_global_batches: %d document(s) are longer than the micro-batch budget of %d tokens and "
            "will be truncated to it (longest: %d tokens); raise tokens_per_step to keep them whole",
            len(truncated),
            budget,
            int(lengths.max()),
        )
    return plan


def _check_int(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"plan_global_batches: {name} must be an int >= {minimum}, got {value!r}")
