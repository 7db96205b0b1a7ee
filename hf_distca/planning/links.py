"""The link model: what a plan's all-to-alls cost in time, and the step's critical path the planner lowers.

The bytes of every rank in each of the engine's four all-to-all phases come from the traffic ledger
(:mod:`hf_distca.planning.traffic`). A rank sends and receives at once, and its traffic inside its node and
across nodes moves at once, so a rank's time in a phase is the largest of (bytes sent or received on a link
class) / (that class's bandwidth). Every collective is a barrier: a phase lasts as long as its slowest rank,
and the kernel between two phases as long as its slowest server. The planner's objective, one layer of a
training step (forward + backward), is therefore

    critical path = max over servers of compute + (1 - overlap) x sum over phases of max over ranks of
                    the rank's phase time

where compute is the server's core-attention time and ``overlap`` the fraction of transfer time that
overlapping communication with compute hides (``DistCAConfig.comm_overlap``). Compute time comes from
the cost model: a measured table (:class:`~hf_distca.planning.cost.MeasuredCost`) is already in seconds;
causal (query, key) pairs are turned into seconds at ``DistCAConfig.attention_tflops``.
"""

from __future__ import annotations

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
from hf_distca.planning.traffic import distinct_phases, link_classes, plan_traffic

__all__ = [
    "FWD_BWD_FLOP_RATIO",
    "LinkModel",
    "attention_flops_per_pair",
    "link_model_from_config",
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

    def critical_path(self, max_cost: float, comm_seconds: float) -> float:
        """Seconds of one layer's core attention on the critical path: the slowest server's compute plus
        the exposed transfer time."""
        return max_cost * self.seconds_per_cost_unit + (1.0 - self.overlap) * comm_seconds


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


def link_model_from_config(config: Any, cost_model: Any, flops_per_pair: float | None) -> LinkModel | None:
    """The link model a :class:`~hf_distca.config.DistCAConfig` asks for; None when communication is
    not priced (``link_gib_per_s`` None: the balance-only plan)."""
    if config.link_gib_per_s is None:
        return None
    intra = config.intra_node_gib_per_s
    return LinkModel(
        inter_bytes_per_s=config.link_gib_per_s * GIB,
        intra_bytes_per_s=math.inf if intra is None else intra * GIB,
        ranks_per_node=config.ranks_per_node,
        overlap=config.comm_overlap,
        seconds_per_cost_unit=seconds_per_cost_unit(cost_model, flops_per_pair, config.attention_tflops),
    )


def plan_critical_path(plan: Any, link: LinkModel, loads: Any = None) -> float:
    """Seconds of one layer's core attention on the critical path under ``plan`` (``loads``: per server
    cost, default the plan's ``load_after``)."""
    loads = plan.load_after if loads is None else loads
    comm = link.comm_seconds(link.phase_seconds(plan_traffic(plan, link.ranks_per_node)))
    return link.critical_path(max(loads, default=0.0), comm)
