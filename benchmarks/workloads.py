"""Benchmark workloads: document-length distributions and the exact documents a recipe run trains on.

A workload is a list of document lengths (a sample) from which a run draws ``num_documents`` lengths,
exactly as ``recipes/finetune_long_docs.py --doc-lengths FILE --num-documents N --seed S`` does, so the
simulator (benchmarks/simulate.py) and the GPU suite (benchmarks/suite.py) replay the same global
batches for every system: same seed, same documents, same steps.

- ``pretrain`` / ``prolong``: the DistCA paper's length samples, passed as file paths (not part of this
  repository).
- ``long-mix``: generated here (:func:`long_document_mix`): short documents of 128-4K tokens and long
  ones of 16K-128K (both log-uniform), mixed so that about two thirds of the tokens are in long documents.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

import numpy as np

from hf_distca.data import plan_global_batches

LONG_MIX = "long-mix"
SHORT_RANGE = (128, 4096)
LONG_RANGE = (16384, 131072)


def long_document_mix(num_documents: int, *, seed: int = 0, long_token_share: float = 2 / 3) -> list[int]:
    """Document lengths with ``long_token_share`` of the tokens (in expectation) in documents of
    16K-128K tokens and the rest in documents of 128-4K tokens, each log-uniform."""
    if num_documents < 1 or not 0 < long_token_share < 1:
        raise ValueError(
            f"need num_documents >= 1 and 0 < long_token_share < 1, got {num_documents}, {long_token_share}"
        )

    def mean(lo: int, hi: int) -> float:  # mean of a log-uniform distribution on [lo, hi]
        return (hi - lo) / math.log(hi / lo)

    # probability p of a long document so that p m_long / (p m_long + (1 - p) m_short) = share
    m_long, m_short = mean(*LONG_RANGE), mean(*SHORT_RANGE)
    p = long_token_share * m_short / (long_token_share * m_short + (1 - long_token_share) * m_long)
    rng = np.random.default_rng(seed)
    is_long = rng.random(num_documents) < p
    lo = np.where(is_long, LONG_RANGE[0], SHORT_RANGE[0])
    hi = np.where(is_long, LONG_RANGE[1], SHORT_RANGE[1])
    lengths = np.exp(rng.uniform(np.log(lo), np.log(hi)))
    return [int(n) for n in np.rint(lengths)]


def load_sample(spec: str, *, seed: int = 0, size: int = 20000) -> tuple[str, list[int]]:
    """(name, sample) of a workload spec: ``long-mix``, a JSON file of lengths, or ``name=path``."""
    if spec == LONG_MIX:
        return LONG_MIX, long_document_mix(size, seed=seed)
    name, sep, path = spec.partition("=")
    if not sep:
        name, path = os.path.splitext(os.path.basename(spec))[0].removeprefix("doclens_"), spec
    with open(path) as f:
        sample = json.load(f)
    if not isinstance(sample, list) or not sample or any(not isinstance(n, int) or n < 1 for n in sample):
        raise ValueError(f"{path}: expected a non-empty JSON list of positive integer document lengths")
    return name, sample


def draw_lengths(sample: Sequence[int], num_documents: int, seed: int) -> list[int]:
    """The document lengths of a run: what ``finetune_long_docs.py --doc-lengths`` draws."""
    return np.random.default_rng(seed).choice(np.asarray(sample, dtype=np.int64), size=num_documents).tolist()


def documents_for(sample: Sequence[int], steps: int, tokens_per_step: int, margin: float = 1.3) -> int:
    """Documents to draw so that the run fills ``steps`` optimizer steps (with a margin for packing)."""
    return max(8, math.ceil(steps * tokens_per_step / float(np.mean(sample)) * margin))


def global_batches(
    lengths: Sequence[int], *, world_size: int, tokens_per_rank: int, grad_accum: int, seed: int, steps: int
) -> list[list[list[int]]]:
    """The first ``steps`` optimizer steps as the training loader builds them: steps -> micro-batches ->
    document lengths (truncated to the micro-batch budget, as the loader truncates them)."""
    budget = world_size * tokens_per_rank
    plan = plan_global_batches(
        lengths, tokens_per_step=budget * grad_accum, micro_batches=grad_accum, seed=seed, epoch=0
    )
    if len(plan) < steps:
        raise ValueError(
            f"{len(lengths)} documents fill only {len(plan)} steps of {budget * grad_accum} tokens; "
            f"draw more documents (--num-documents) or simulate fewer steps"
        )
    return [[[min(lengths[i], budget) for i in mb] for mb in step] for step in plan[:steps]]
