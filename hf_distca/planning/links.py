"""The link model: what a plan's all-to-alls cost in time, and the step's critical path the planner lowers.

The bytes of every rank in each of the engine's four all-to-all phases come from the traffic ledger
(:mod:`hf_distca.planning.traffic`). A rank sends and receives at once, and its traffic inside its node and
across nodes moves at once, so a rank's time in a phase is the largest of (bytes sent or received on a link
class) / (that class's bandwidth). Every collective is a barrier: a phase lasts as long as its slowest rank,
and the kernel between two phases as long as its slowest server. The planner's objective, one layer of a
training step (forward + backward), is therefore

    critical path = max over servers of compute + exposed(sum over phases of max over ranks of the
                    rank's phase time)
    exposed(transfer) = max(0, (1 - overlap) x transfer - hiding)

where compute is the server's core-attention time, ``overlap`` the fraction of transfer time that
overlapping communication with compute hides (``DistCAConfig.comm_overlap``) and ``hiding`` the seconds of
other work each phase flies behind: under layer-level ping-pong the other nano-batch's layer work or
kernels (:func:`with_hiding_work`, from ``DistCAConfig.layer_seconds_per_token``), else none. With such
work, ``exposed`` is the sum over the phases of ``max(0, share x (1 - overlap) x transfer - hiding)``. Compute time comes from
the cost model: a measured table (:class:`~hf_distca.planning.cost.MeasuredCost`) is already in seconds;
causal (query, key) pairs are turned into seconds at ``DistCAConfig.attention_tflops``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from hf_distca.planning.cost import (
    FWD_BWD_FLOP_RATIO,
    CausalPairsCost,
    MeasuredCost,
    attention_flops_per_pair,
)
from hf_distca.planning.options import PlannerOptions
from hf_distca.planning.traffic import (
    CARRIES,
    INTER,
    INTRA,
    PHASES,
    distinct_phases,
    forward_phases,
    link_classes,
    plan_traffic,
    send_weights,
)

__all__ = [
    "FWD_BWD_FLOP_RATIO",
    "LAYER_FORWARD_SHARE",
    "Changes",
    "LinkModel",
    "PhaseTimes",
    "attention_flops_per_pair",
    "with_hiding_work",
    "layer_seconds_per_token",
    "link_model_from_options",
    "plan_critical_path",
    "seconds_per_cost_unit",
]

GIB = 2**30


@dataclass(frozen=True)
class LinkModel:
    """Bandwidths, topology and the compute rate that price a plan in seconds (see the module docstring)."""

    inter_bytes_per_s: float
    """Bandwidth of one rank between nodes (or between all ranks when ``ranks_per_node`` is None), bytes/s;
    ``math.inf``: free."""
    intra_bytes_per_s: float
    """Bandwidth of one rank inside its node, bytes/s (``math.inf``: free); used only with ``ranks_per_node``."""
    ranks_per_node: int | None
    """Consecutive ranks sharing a node; None: one link class for every pair of ranks."""
    overlap: float
    """Fraction of transfer time hidden under compute, in [0, 1]."""
    seconds_per_cost_unit: float
    """Seconds of one layer's forward+backward core attention per unit of the cost model."""
    hiding: tuple[tuple[float, float], ...] = ()
    """Per all-to-all phase of a layer, (its share of the layer's transfer time, seconds of other work it
    flies behind) (:func:`with_hiding_work`); empty: no such work."""
    kv_relay: bool = False
    """KV rows through the per-node relay (``DistCAConfig.kv_relay``, :mod:`hf_distca.planning.relay`):
    priced with their two stages in one table, moving at once like the link classes (the second stage
    runs inside a node, after the first)."""

    def link_class(self, a: int, b: int) -> int:
        """The link class of ranks ``a`` and ``b`` (:func:`~hf_distca.planning.traffic.link_classes`)."""
        return link_classes(a, b, self.ranks_per_node)

    @property
    def inverse_bandwidth(self) -> np.ndarray:
        """Seconds per byte of each link class, (2,): [INTRA, INTER]."""
        return np.array([1.0 / self.intra_bytes_per_s, 1.0 / self.inter_bytes_per_s])

    def phase_seconds(self, traffic: np.ndarray) -> np.ndarray:
        """Per rank, seconds of each of the ledger's distinct phases
        (:func:`~hf_distca.planning.traffic.distinct_phases`) from ``traffic`` (ranks, 2 link classes, 4
        columns Q_OUT, KV_OUT, Q_IN, KV_IN) in bytes; shape (ranks, phases)."""
        send, recv, _ = distinct_phases()  # (k, 4) each
        by_class = np.maximum(traffic @ send.T, traffic @ recv.T)  # (ranks, 2, k) bytes
        return (by_class * self.inverse_bandwidth[:, None]).max(axis=-2)  # (ranks, k)

    def comm_seconds(self, phase_seconds: np.ndarray) -> float:
        """One layer's all-to-all time (forward + backward): every phase lasts as long as its slowest rank;
        a distinct phase counts as often as the ledger runs it."""
        if phase_seconds.size == 0:
            return 0.0
        slowest = phase_seconds.max(axis=0)  # (k,)
        total = 0.0
        for count, seconds in zip(distinct_phases()[2], slowest, strict=True):
            total += float(count) * seconds
        return float(total)

    def exposed(self, comm_seconds: float) -> float:
        """Seconds of one layer's transfers (``comm_seconds``, forward + backward) left exposed: the share
        overlap does not hide, less, phase by phase, the work each flies behind."""
        seconds = (1.0 - self.overlap) * comm_seconds
        if not self.hiding:
            return seconds
        return sum(max(0.0, share * seconds - hiding) for share, hiding in self.hiding)

    def critical_path(self, max_cost: float, comm_seconds: float) -> float:
        """Seconds of one layer's core attention on the critical path: the slowest server's compute plus
        the exposed transfer time."""
        return max_cost * self.seconds_per_cost_unit + self.exposed(comm_seconds)


def seconds_per_cost_unit(cost_model: Any, flops_per_pair: float | None, attention_tflops: float) -> float:
    """Seconds of one layer's forward+backward core attention per unit of ``cost_model``.

    :class:`MeasuredCost` is in seconds of what it timed (x 3.5 for a forward-only table); causal pairs
    cost ``flops_per_pair`` FLOPs at ``attention_tflops``; any other model must have a
    ``seconds_per_unit`` attribute."""
    if isinstance(cost_model, MeasuredCost):
        return 1.0 if cost_model.timed == "forward+backward" else FWD_BWD_FLOP_RATIO
    if isinstance(cost_model, CausalPairsCost):
        if flops_per_pair is None:
            raise ValueError(
                "pricing communication (DistCAConfig.link_gib_per_s) with the causal-pairs cost model needs "
                "flops_per_pair, the forward+backward FLOPs of one (query, key) pair: pass "
                "flops_per_pair=hf_distca.planning.attention_flops_per_pair(q_heads, head_dim)"
            )
        return flops_per_pair / (attention_tflops * 1e12)
    per_unit = getattr(cost_model, "seconds_per_unit", None)
    if per_unit is None:
        raise ValueError(
            f"cost model {cost_model!r} has no seconds_per_unit attribute: it cannot be priced against "
            "transfer time (DistCAConfig.link_gib_per_s); give it one, or leave link_gib_per_s None"
        )
    return float(per_unit)


def link_model_from_options(
    options: PlannerOptions, cost_model: Any, flops_per_pair: float | None
) -> LinkModel | None:
    """The link model the planner's ``options`` ask for; None when communication is not priced
    (``link_gib_per_s`` None: the balance-only plan)."""
    if options.link_gib_per_s is None:
        return None
    intra = options.intra_node_gib_per_s
    return LinkModel(
        inter_bytes_per_s=options.link_gib_per_s * GIB,
        intra_bytes_per_s=math.inf if intra is None else intra * GIB,
        ranks_per_node=options.ranks_per_node,
        overlap=options.comm_overlap,
        seconds_per_cost_unit=seconds_per_cost_unit(cost_model, flops_per_pair, options.attention_tflops),
        kv_relay=options.kv_relay,
    )


def with_hiding_work(
    link: LinkModel,
    options: PlannerOptions,
    tokens_per_rank: float,
    mean_cost: float,
    q_row_bytes: int,
    kv_row_bytes: int,
) -> LinkModel:
    """``link`` with the work each all-to-all phase flies behind under layer-level ping-pong
    (``options.layer_seconds_per_token``; ``link`` unchanged when None). In the engine's order
    (the simulator's ``layer_ping_pong`` schedule, benchmarks/sim/schedule.py) one phase of each pass flies behind the other
    nano-batch's layer work of that pass and the other behind its kernel: a dispatch and a return per pass,
    which one behind which depending on the nano-batch's turn. Taken here the unfavourable way (the larger
    phase behind the shorter work), with the other nano-batch's work equal to this one's (the split gives
    them about equal estimated cost): layer work ``layer_seconds_per_token x tokens_per_rank``, a quarter
    of it in forward (forward, recompute and backward at about 1 : 1 : 2 under checkpointing), kernels
    ``mean_cost`` (this nano-batch's core-attention cost per server, which moves do not change) in
    seconds, 1 / FWD_BWD_FLOP_RATIO of it in forward. A phase's share of the transfer time: its bytes per
    row moved as the ledger carries them (:data:`~hf_distca.planning.traffic.CARRIES`), query and KV rows
    counted alike."""
    per_token = options.layer_seconds_per_token
    if per_token is None:
        return link
    layer = per_token * tokens_per_rank
    kernel = mean_cost * link.seconds_per_cost_unit
    work = {
        "fwd": (LAYER_FORWARD_SHARE * layer, kernel / FWD_BWD_FLOP_RATIO),
        "bwd": ((1.0 - LAYER_FORWARD_SHARE) * layer, kernel * (1.0 - 1.0 / FWD_BWD_FLOP_RATIO)),
    }
    row = np.array([q_row_bytes, kv_row_bytes], dtype=np.float64)
    weight = {p: float(CARRIES[i].sum(axis=0) @ row) for i, p in enumerate(PHASES)}  # bytes per row moved
    total = sum(weight.values())
    hiding = []
    for pass_, (a, b) in work.items():
        phases = sorted((p for p in PHASES if p.startswith(pass_)), key=lambda p: -weight[p])
        for phase, seconds in zip(phases, sorted((a, b)), strict=True):  # the larger phase, the shorter work
            hiding.append((weight[phase] / total, float(seconds)))
    return dataclasses.replace(link, hiding=tuple(hiding))


LAYER_FORWARD_SHARE = 0.25
"""Forward's share of a layer's work besides core attention under activation checkpointing (forward,
recompute and backward at about 1 : 1 : 2 of the matmul FLOPs)."""


def layer_seconds_per_token(layer_weights: int, layer_tflops: float) -> float:
    """Seconds per token of one decoder layer's matmuls with ``layer_weights`` weights (its projections and
    MLP) at ``layer_tflops``: 2 FLOPs per weight and token in forward, and forward, recompute and backward
    take 1 / LAYER_FORWARD_SHARE forwards under activation checkpointing."""
    return 2.0 * layer_weights / LAYER_FORWARD_SHARE / (layer_tflops * 1e12)


def plan_critical_path(
    plan: Any, link: LinkModel, loads: Any = None, table: np.ndarray | None = None
) -> float:
    """Seconds of one layer's core attention on the critical path under ``plan`` (``loads``: per server
    cost, default the plan's ``load_after``; ``table``: the plan's
    :func:`~hf_distca.planning.traffic.plan_traffic` with the link's topology, when already computed)."""
    loads = plan.load_after if loads is None else loads
    table = plan_traffic(plan, link.ranks_per_node, link.kv_relay) if table is None else table
    comm = link.comm_seconds(link.phase_seconds(table))
    return link.critical_path(max(loads, default=0.0), comm)


Changes = dict[int, list[list[float]]]
"""rank -> byte deltas per link class [INTRA, INTER] x [Q_OUT, KV_OUT, Q_IN, KV_IN]."""


class PhaseTimes:
    """The link model kept up to date under a changing assignment (the planner's greedy): exact bytes per
    rank and link class (the ledger's forward-dispatch columns), each rank's seconds in the ledger's
    distinct phases, and the all-to-all time they add up to; prices a change without applying it."""

    TOP = 8  # ranks kept per phase, slowest first: a move touches a few ranks, the max of the rest is here

    def __init__(self, link: LinkModel, world: int):
        self.link = link
        self.world = world
        self.inverse = tuple(float(x) for x in link.inverse_bandwidth)
        # the ledger's distinct phases: per phase, (column, weight) terms of what a rank sends / receives
        send, recv, counts = distinct_phases()
        self.send_matrix, self.recv_matrix = send.astype(np.float64), recv.astype(np.float64)  # (k, 4)
        self.terms = [
            tuple(tuple((j, float(w)) for j, w in enumerate(row) if w) for row in (send[d], recv[d]))
            for d in range(len(counts))
        ]
        self.counts = [float(c) for c in counts]
        self.forward_send = send_weights()[forward_phases()].sum(axis=0).astype(np.float64)  # (4,)
        self.forward_terms = tuple((j, float(w)) for j, w in enumerate(self.forward_send) if w)
        self.bytes = [[[0.0] * 4 for _ in range(2)] for _ in range(world)]
        self.array = np.zeros((world, 2, 4))  # the same bytes, for pricing moves that touch many ranks
        self.phase = np.zeros((world, len(counts)))
        self.top: list[list[tuple[float, int]]] = [[] for _ in counts]
        self.now = 0.0  # comm_seconds() of the current bytes

    def clone(self) -> PhaseTimes:
        other = object.__new__(PhaseTimes)
        other.__dict__.update(self.__dict__)  # the link model and the ledger's terms are shared
        other.bytes = list(self.bytes)  # apply() replaces a rank's rows, never edits them
        other.array = self.array.copy()
        other.phase = self.phase.copy()
        other.top = [list(t) for t in self.top]
        other.now = self.now
        return other

    def rank_phases(self, b: list[list[float]]) -> list[float]:
        """Seconds of a rank's distinct phases from its bytes (as ``LinkModel.phase_seconds``)."""
        out = [0.0] * len(self.terms)
        for c in (INTRA, INTER):
            w = self.inverse[c]
            if w == 0.0:
                continue
            row = b[c]
            for d, (send, recv) in enumerate(self.terms):
                s = r = 0.0
                for j, x in send:
                    s += x * row[j]
                for j, x in recv:
                    r += x * row[j]
                out[d] = max(out[d], max(s, r) * w)
        return out

    def after(self, changes: Changes) -> dict[int, list[list[float]]]:
        """The new bytes of every rank ``changes`` touches."""
        out = {}
        for r, delta in changes.items():
            old = self.bytes[r]
            out[r] = [[old[c][j] + delta[c][j] for j in range(4)] for c in (INTRA, INTER)]
        return out

    def sent(self, b: list[list[float]]) -> float:
        """Bytes a rank sends in one forward call (the ledger's forward phases)."""
        total = 0.0
        for c in (INTRA, INTER):
            row = b[c]
            for j, x in self.forward_terms:
                total += x * row[j]
        return total

    def comm_seconds(self, new_phases: dict[int, list[float]] | None = None) -> float:
        """One layer's all-to-all seconds now, or with the ranks of ``new_phases`` at those phase times."""
        new_phases = new_phases or {}
        slowest = [max((v[p] for v in new_phases.values()), default=0.0) for p in range(len(self.counts))]
        return self._comm_with(slowest, new_phases)

    def _comm_with(self, slowest: list[float], touched) -> float:
        """One layer's all-to-all seconds when the ranks in ``touched`` take at most ``slowest`` (per phase)
        and every other rank its current phase times."""
        total = 0.0
        for p, weight in enumerate(self.counts):
            rest = None
            for value, r in self.top[p]:
                if r not in touched:
                    rest = value
                    break
            if rest is None and len(self.top[p]) < self.world:  # every kept rank is touched: look at all
                mask = np.ones(self.world, dtype=bool)
                mask[list(touched)] = False
                rest = float(self.phase[mask, p].max()) if mask.any() else 0.0
            total += weight * max(slowest[p], rest or 0.0)
        return total

    MANY = 24
    """Moves touching at least this many ranks are priced with arrays (:meth:`exposed_many`)."""

    def exposed_many(self, changes: Changes, bound: float | None) -> float | None:
        """comm_seconds() with ``changes`` applied minus now, computed on arrays with the same arithmetic as
        :meth:`after`, :meth:`sent`, :meth:`rank_phases` and :meth:`comm_seconds`; None when a rank would
        go over the send bound ``bound``."""
        ranks = list(changes)
        rows = np.array(ranks, dtype=np.int64)
        old = self.array[rows]  # (k, 2, 4)
        new = old + np.array([changes[r] for r in ranks], dtype=np.float64)
        if bound is not None:
            sent_new, sent_old = ((b @ self.forward_send).sum(axis=1) for b in (new, old))  # (n,) each
            if np.any((sent_new > bound) & (sent_new > sent_old)):
                return None
        phases = np.zeros((len(ranks), len(self.counts)))
        for c in (INTRA, INTER):
            w = self.inverse[c]
            if w == 0.0:
                continue
            by_phase = np.maximum(new[:, c] @ self.send_matrix.T, new[:, c] @ self.recv_matrix.T)  # (n, k)
            phases = np.maximum(phases, by_phase * w)
        slowest = [float(x) for x in phases.max(axis=0)]  # (k,)
        return self._comm_with(slowest, set(ranks)) - self.now

    def apply(self, changes: Changes) -> None:
        for r, b in self.after(changes).items():
            self.bytes[r] = b
            self.array[r] = b
            self.phase[r] = self.rank_phases(b)
        self._refresh_top()
        self.now = self.comm_seconds()

    def _refresh_top(self) -> None:
        k = min(self.TOP, self.world)
        for p in range(len(self.counts)):
            column = self.phase[:, p]
            ranks = np.argpartition(-column, k - 1)[:k] if k < self.world else np.arange(self.world)
            self.top[p] = sorted(((float(column[r]), int(r)) for r in ranks), reverse=True)
