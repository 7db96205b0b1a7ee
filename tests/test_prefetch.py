"""Planning ahead in the background process (hf_distca.engine.prefetch): the engine takes the plan it
would have made, in every context it planned in (here a full-causal and a windowed layer, priced links
and a measured cost table), and the data path submits each coming micro-batch's layout."""

from __future__ import annotations

import random
import time

import pytest
import torch
from distributed import run_distributed
from oracle import scatter

from hf_distca import DistCAConfig, metrics, plan_core_attention
from hf_distca.data import DistCABatches
from hf_distca.engine import engine_state, prefetch
from hf_distca.engine.prepare import _planned
from hf_distca.planning import MeasuredCost, attention_flops_per_pair, causal_pairs

WORLD, RANK, HQ, HKV, D = 4, 1, 4, 2, 8
CONFIG = DistCAConfig(tolerance=0.05, shard_tokens=16, link_gib_per_s=1e-3, attention_tflops=1e-3)
WINDOWS = (None, 64)  # a global and a local layer: two contexts


def _measured() -> MeasuredCost:
    lens = [16, 64, 256, 1024]
    return MeasuredCost(
        lens, lens, [[1e-9 * causal_pairs(max(k - q, 0), k) + 2e-6 for k in lens] for q in lens]
    )


def _layout(seed: int) -> list[list[tuple[int, int, int]]]:
    rng = random.Random(seed)
    pieces = scatter(
        "s", [rng.randint(1, 400) for _ in range(10)], WORLD, rng, max_pieces=3, spread=(1, 4)
    ).pieces
    return [[tuple(p) for p in r] for r in pieces]


def _plan(all_pieces, window, rank=RANK):
    """The engine's prepared plan of ``all_pieces`` on ``rank`` (q/k only give shapes and element size)."""
    q = torch.zeros(sum(p[2] for p in all_pieces[rank]), HQ, D)
    k = torch.zeros(q.shape[0], HKV, D)
    return _planned(all_pieces, prefetch.pieces_digest(all_pieces), rank, q, k, CONFIG, window, _measured())


def _summary(plan) -> tuple:
    return (plan.digest(), plan.tasks, plan.pairs_after, plan.load_after, plan.bytes_sent, plan.moves,
            plan.critical_path_before, plan.critical_path_after)  # fmt: skip


def test_prefetched_plans_are_the_inline_plans_and_are_used():
    engine_state().prefetcher.start(wait=True)  # until the worker runs, the engine plans inline
    engine_state().reset()
    metrics.reset()
    first, second = _layout(0), _layout(1)
    assert engine_state().prefetcher.prefetch_plans(second) == 0  # no context before the engine's first plan
    for window in WINDOWS:  # the engine plans the first micro-batch inline, remembering both contexts
        _plan(first, window)
    assert (metrics.snapshot().plans, metrics.snapshot().plans_prefetched) == (2, 0)
    assert engine_state().prefetcher.prefetch_plans(second) == len(WINDOWS)
    assert engine_state().prefetcher.prefetch_plans(second) == 0  # already pending
    assert engine_state().prefetcher.prefetch_plans(second[:-1]) == 0  # another group size: no context
    for window in WINDOWS:
        prepared = _plan(second, window)
        inline = plan_core_attention(  # the oracle: the planner called directly with the engine's arguments
            second,
            q_row_bytes=HQ * D * 4,
            kv_row_bytes=2 * HKV * D * 4,
            options=CONFIG.planner_options(),
            cost_model=_measured().with_window(window),
            flops_per_pair=attention_flops_per_pair(HQ, D),
            window=window,
        )
        assert inline.moves > 0 and inline.critical_path_after is not None  # priced, work moved
        assert _summary(prepared.plan) == _summary(inline), window
    s = metrics.snapshot()
    assert (s.plans, s.plans_prefetched) == (4, 2)
    assert s.plan_seconds > 0
    # another rank's key is another plan: not taken from this rank's prefetch
    _plan(second, None, rank=0)
    assert metrics.snapshot().plans_prefetched == 2
    engine_state().reset()


def test_loader_prefetches_the_next_micro_batch():
    """DistCABatches(prefetch_plans=True) submits micro-batch i+1's layout when it yields micro-batch i, and
    the engine's plan of micro-batch i+1 comes from there; without the flag, nothing is submitted."""
    docs = [[1] * n for n in (300, 500, 200, 700, 400, 600, 250, 350)]
    kwargs = dict(rank=RANK, world_size=WORLD, tokens_per_rank=256, grad_accum=2, seed=1)
    engine_state().prefetcher.start(wait=True)
    for enabled in (False, True):
        engine_state().reset()
        metrics.reset()
        layouts = []
        for batch in DistCABatches(docs, prefetch_plans=enabled, **kwargs):
            layout = batch["distca_layout"]
            layouts.append(layout.all_pieces)
            _plan([list(p) for p in layout.all_pieces], 64)
        s = metrics.snapshot()
        assert len(layouts) >= 3 and len(set(layouts)) == len(layouts) == s.plans
        # the first micro-batch is planned before any context exists, the second is submitted before that
        assert s.plans_prefetched == (len(layouts) - 2 if enabled else 0)
    engine_state().reset()


def _fails_with_the_worker_running(rank: int, world: int) -> None:
    engine_state().prefetcher.start(wait=True)
    raise RuntimeError("a planned failure with the planning worker running")


def test_a_failing_rank_exits_with_its_planning_worker():
    """A multiprocessing child ends without atexit handlers and joins its children: the worker is stopped
    first (else the rank waits for it forever and the launch hangs instead of failing)."""
    start = time.monotonic()
    with pytest.raises(AssertionError, match="a planned failure"):
        run_distributed(_fails_with_the_worker_running, 2, timeout=90)
    assert time.monotonic() - start < 90  # a rank that hung would have been waited for, then killed
