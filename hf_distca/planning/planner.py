"""plan_core_attention: cut core attention into CA-tasks and balance them over attention servers.

Pure Python/NumPy. Every rank calls it with the same all-gathered pieces and gets the same plan, so no plan
is ever broadcast. This module decides which candidate plan wins; the greedy that makes each candidate is
:mod:`hf_distca.planning.balancer`, the bytes a plan moves come from the traffic ledger
(:mod:`hf_distca.planning.traffic`) and their time from the link model (:mod:`hf_distca.planning.links`).

Without a link bandwidth (``PlannerOptions.link_gib_per_s`` None) the plan is the balance-only greedy's:
every server within ``PlannerOptions.balance_tolerance`` of the mean cost. With one, the step's critical path is the slowest
server's compute plus the exposed time of the engine's all-to-alls, each as long as its slowest rank (under
layer-level ping-pong with ``PlannerOptions.layer_seconds_per_token``, less the hiding work of the other
nano-batch they fly behind: :func:`~hf_distca.planning.links.with_hiding_work`). The
balance-only plan is kept when its transfer time is within ``balance_tolerance`` of its critical path and it is no
slower than no balancing (so free links, infinite bandwidth or ``comm_overlap`` 1, give exactly the
balance-only plan). Otherwise priced greedies run: one balances to the mean, others fill destinations up to
levels above it (fewer servers per long document, each taking more of it); each keeps its moves up to its
lowest critical path, and the plan is the lowest of them, of the balance-only plan and of no balancing:
never slower, in the model, than either.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Sequence

from hf_distca.planning.balancer import Balancer
from hf_distca.planning.cost import CausalPairsCost
from hf_distca.planning.links import LinkModel, link_model_from_options, plan_critical_path, with_hiding_work
from hf_distca.planning.options import PlannerOptions
from hf_distca.planning.pieces import DocIndex
from hf_distca.planning.tasks import CATask, CorePlan
from hf_distca.planning.traffic import forward_bytes, plan_traffic
from hf_distca.planning.window import as_window, attended_pairs

__all__ = ["CATask", "CorePlan", "LEVEL_START", "LEVEL_STEP", "plan_core_attention"]


LEVEL_STEP = 1.2
"""Ratio between successive balance levels (on Pretrain/ProLong batches at 512 servers, 1.12 found
critical paths within 2% of 1.2's in 1.3x the time)."""
LEVEL_START = 1.1
"""The balance levels tried when transfer time matters are ``LEVEL_START x mean x LEVEL_STEP^j``, j >= 1:
a fixed grid, whatever the tolerance the greedy balances to."""


def plan_core_attention(
    pieces_per_rank: Sequence[Sequence[Sequence[int]]],
    *,
    q_row_bytes: int,
    kv_row_bytes: int,
    options: PlannerOptions | None = None,
    cost_model=None,
    flops_per_pair: float | None = None,
    window: int | None = None,
) -> CorePlan:
    """Plan one micro-batch's core attention over ``len(pieces_per_rank)`` in-place servers.

    pieces_per_rank[r]: rank r's pieces ``(doc_id, doc_start, length)`` in local order.
    q_row_bytes: bytes of one token's queries (heads x head_dim x element size); the same for outputs.
    kv_row_bytes: bytes of one token's keys plus values.
    options: the balance target, bounds and links (:class:`~hf_distca.planning.options.PlannerOptions`;
    ``DistCAConfig.planner_options()`` gives a user config's); default ``PlannerOptions()``.
    cost_model: object with ``task_cost(a, b)``; default :class:`CausalPairsCost` (causal (query, key)
    pairs). :func:`hf_distca.config.cost_model_from_config` gives the one a user config asks for.
    flops_per_pair: forward+backward FLOPs of one (query, key) pair
    (:func:`~hf_distca.planning.links.attention_flops_per_pair`); needed to price causal pairs in
    seconds when ``options.link_gib_per_s`` is set.
    window: the layer's sliding window (None: full causal): a task [a, b) then reads keys
    [max(0, a - window + 1), b) and costs its windowed pairs (:mod:`hf_distca.planning.window`); the cost
    model is given this window (its ``with_window``).
    """
    window = as_window(window)
    cost = cost_model or CausalPairsCost()
    if hasattr(cost, "with_window"):
        cost = cost.with_window(window)
    elif window is not None:
        raise ValueError(f"cost model {cost!r} has no with_window(): it cannot price a sliding window")
    with _collector_paused():
        return _plan(
            pieces_per_rank, q_row_bytes, kv_row_bytes, options or PlannerOptions(), cost, flops_per_pair
        )


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while planning: a plan allocates ~1e5 small long-lived
    objects (intervals, tasks), which trigger full collections that scan the whole heap of the training
    process (a third of the planning time measured at 512 servers). Reference counting still frees
    everything a plan drops: it builds no reference cycles."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _plan(
    pieces_per_rank, q_row_bytes: int, kv_row_bytes: int, options: PlannerOptions, cost_model, flops_per_pair
) -> CorePlan:
    cost = cost_model
    link = link_model_from_options(options, cost, flops_per_pair)
    index = DocIndex(pieces_per_rank)
    balance_only = Balancer(index, cost, options, None, q_row_bytes, kv_row_bytes)
    before = (list(balance_only.loads), balance_only.pairs())
    if link is None:
        balance_only.balance()
        return _finish(balance_only, before, None, None)
    world = max(len(index.tokens_per_rank), 1)
    link = with_hiding_work(
        link, options, sum(index.tokens_per_rank) / world, sum(before[0]) / world, q_row_bytes, kv_row_bytes
    )

    origin = balance_only.priced(link)
    unbalanced = origin.path[0]  # the critical path with every rank computing its own pieces
    balance_only.balance()
    plan = _finish(balance_only, before, link, None, unbalanced)
    exposed = plan.critical_path_after - link.critical_path(max(plan.load_after, default=0.0), 0.0)
    if (
        exposed <= options.balance_tolerance * plan.critical_path_after
        and plan.critical_path_after <= unbalanced
    ):
        return plan  # communication costs less than the imbalance the tolerance accepts
    # priced greedies, balancing to the mean and then filling destinations up to higher levels (fewer
    # servers per long document, each taking more of it); the lowest critical path wins
    best = min(plan.critical_path_after, unbalanced)
    chosen = None
    for level in [None, *_levels(before[0])]:
        trial = origin.clone()
        trial.balance(level, give_up_above=best)
        keep = trial.best_prefix()
        if trial.path[keep] < best:
            best, chosen = trial.path[keep], (trial, keep, level)
    if chosen is not None:
        trial, keep, level = chosen
        if keep < len(trial.moves):
            moves, trial = trial.moves[:keep], origin.clone()
            for move in moves:
                trial.apply(move)
        priced = _finish(trial, before, link, level, unbalanced)
        if priced.critical_path_after < min(plan.critical_path_after, unbalanced):
            return priced
    if plan.critical_path_after <= unbalanced:
        return plan
    return _finish(origin, before, link, None, unbalanced)


def _finish(
    balancer: Balancer,
    before: tuple[list[float], list[int]],
    link: LinkModel | None,
    level: float | None,
    critical_path_before: float | None = None,
) -> CorePlan:
    """The plan of a balancer's current assignment, priced under ``link`` when given
    (``critical_path_before``: that of no moves; default: this plan's own)."""
    window = balancer.window
    tasks, kv = balancer.assignment()
    cost = balancer.cost
    plan = CorePlan(
        index=balancer.index,
        tasks=tasks,
        kv_ranges=kv,
        load_before=before[0],
        load_after=[sum(cost.task_cost(t.q_start, t.q_end) for t in ts) for ts in tasks],
        pairs_before=before[1],
        pairs_after=[sum(attended_pairs(t.q_start, t.q_end, window) for t in ts) for ts in tasks],
        q_row_bytes=balancer.q_row,
        kv_row_bytes=balancer.kv_row,
        moves=len(balancer.moves),
        balance_level=level,
        window=window,
    )
    # (ranks, 2, 4): what the engine sends, through the relay when the config asks for it, priced or not
    relay = balancer.relayed
    table = plan_traffic(plan, balancer.options.ranks_per_node if link is not None or relay else None, relay)
    plan.bytes_sent, plan.bytes_received = forward_bytes(plan, table)
    if link is not None:
        plan.critical_path_after = plan_critical_path(plan, link, table=table)
        if balancer.path and not math.isclose(balancer.path[-1], plan.critical_path_after, rel_tol=1e-9):
            raise AssertionError(
                f"planner bug: the greedy priced {balancer.path[-1]!r} s, the plan's own bytes give "
                f"{plan.critical_path_after!r} s"
            )
        plan.critical_path_before = (
            plan.critical_path_after if critical_path_before is None else critical_path_before
        )
    return plan


def _levels(loads: Sequence[float]) -> list[float]:
    """Balance levels above the mean tried when transfer time matters: LEVEL_START x mean x LEVEL_STEP^j
    for j >= 1, below the most loaded server."""
    mean = sum(loads) / len(loads)
    out, level = [], LEVEL_START * mean * LEVEL_STEP
    while level < max(loads):
        out.append(level)
        level *= LEVEL_STEP
    return out
