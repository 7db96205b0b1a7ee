"""The link model: what a plan's all-to-alls cost in time, and the step's critical path the planner lowers.

The engine runs four all-to-all-v phases per layer of a training step (see :mod:`hf_distca.engine.op`):
forward dispatch (q, k, v from holders to servers), forward return (outputs home), backward dispatch
(q, out, dout, k, v) and backward return (dq, dk, dv home). With Q / KV a rank's query / KV-prefix bytes
of one forward dispatch (``q_row_bytes`` / ``kv_row_bytes`` per row), "out" what it sends as a holder
and "in" what it receives as a server, the bytes of one rank in each phase are

    phase              sends                   receives
    forward dispatch   Q_out + KV_out          Q_in + KV_in
    forward return     Q_in                    Q_out
    backward dispatch  3 Q_out + KV_out        3 Q_in + KV_in
    backward return    Q_in + KV_in            Q_out + KV_out

A rank sends and receives at once, and its traffic inside its node and across nodes moves at once, so
a rank's time in a phase is the largest of (bytes sent or received on a link class) / (that class's
bandwidth). Every collective is a barrier: a phase lasts as long as its slowest rank, and the kernel
between two phases as long as its slowest server. The planner's objective, one layer of a training step
(forward + backward), is therefore

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

from hf_distca.planning.cost import CausalPairsCost, MeasuredCost

FWD_BWD_FLOP_RATIO = 3.5
"""Forward+backward over forward FLOPs of attention: forward 2 matmuls (4 FLOPs per pair and head
dimension), backward 5 (10)."""

GIB = 2**30

# columns of the per-rank, per-link-class byte counts
Q_OUT, KV_OUT, Q_IN, KV_IN = range(4)
INTRA, INTER = 0, 1


def attention_flops_per_pair(q_heads: int, head_dim: int) -> float:
    """Forward+backward FLOPs of one causal (query, key) pair: 4 x heads x head_dim forward, x 3.5."""
    return 4.0 * q_heads * head_dim * FWD_BWD_FLOP_RATIO


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
        """INTRA when ranks ``a`` and ``b`` share a node, else INTER (INTER for every pair without a topology)."""
        if self.ranks_per_node is not None and a // self.ranks_per_node == b // self.ranks_per_node:
            return INTRA
        return INTER

    @property
    def inverse_bandwidth(self) -> np.ndarray:
        """Seconds per byte of each link class, (2,): [INTRA, INTER]."""
        return np.array([1.0 / self.intra_bytes_per_s, 1.0 / self.inter_bytes_per_s])

    def phase_seconds(self, traffic: np.ndarray) -> np.ndarray:
        """Per rank, seconds of its three distinct phases: [dispatch (= backward return), forward return,
        backward dispatch], from ``traffic`` (ranks, 2 link classes, 4 columns Q_OUT, KV_OUT, Q_IN, KV_IN) in
        bytes; shape (ranks, 3)."""
        q_out, kv_out = traffic[..., Q_OUT], traffic[..., KV_OUT]
        q_in, kv_in = traffic[..., Q_IN], traffic[..., KV_IN]
        by_class = np.stack(
            [
                np.maximum(q_out + kv_out, q_in + kv_in),
                np.maximum(q_in, q_out),
                np.maximum(3 * q_out + kv_out, 3 * q_in + kv_in),
            ],
            axis=-1,
        )  # (ranks, 2, 3) bytes
        return (by_class * self.inverse_bandwidth[:, None]).max(axis=-2)  # (ranks, 3)

    def comm_seconds(self, phase_seconds: np.ndarray) -> float:
        """One layer's all-to-all time (forward + backward): every phase lasts as long as its slowest rank;
        the dispatch column counts twice (forward dispatch and backward return move the same bytes)."""
        if phase_seconds.size == 0:
            return 0.0
        slowest = phase_seconds.max(axis=0)  # (3,)
        return float(2.0 * slowest[0] + slowest[1] + slowest[2])

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


def add_bytes(
    table: np.ndarray, ranks: np.ndarray, link_class: np.ndarray, column: int, nbytes: np.ndarray
) -> None:
    """``table[rank, link class, column] += bytes`` for every entry (repeats add up): a (ranks, 2, 4) table."""
    flat = (ranks * 2 + link_class) * 4 + column
    table += np.bincount(flat, weights=nbytes, minlength=table.size).reshape(table.shape)


def plan_rows(plan: Any) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """The rows a :class:`~hf_distca.planning.CorePlan` moves in one forward dispatch, as (holder, server, rows) arrays with holder !=
    server: query rows of every task, and the key rows of every server's key ranges (each once; the KV
    prefixes without a sliding window)."""
    docs, starts, ends, servers = [], [], [], []
    for server, tasks in enumerate(plan.tasks):
        for t in tasks:
            docs.append(t.doc_id)
            starts.append(t.q_start)
            ends.append(t.q_end)
            servers.append(server)
    kv_docs, kv_starts, kv_ends, kv_servers = [], [], [], []
    for server, per_doc in enumerate(plan.kv_ranges):
        for doc, ranges in per_doc.items():
            for lo, hi in ranges:
                kv_docs.append(doc)
                kv_starts.append(lo)
                kv_ends.append(hi)
                kv_servers.append(server)
    out = []
    for d, a, b, srv in ((docs, starts, ends, servers), (kv_docs, kv_starts, kv_ends, kv_servers)):
        request, holder, rows = plan.index.segment_rows(d, a, b)
        server = np.asarray(srv, dtype=np.int64)[request]
        remote = holder != server
        out.append((holder[remote], server[remote], rows[remote]))
    return out[0], out[1]


def plan_traffic(plan: Any, link: LinkModel) -> np.ndarray:
    """Bytes of one forward dispatch per rank and link class, (ranks, 2, 4) with columns Q_OUT, KV_OUT,
    Q_IN, KV_IN, recomputed from a :class:`~hf_distca.planning.CorePlan`'s tasks and KV prefixes."""
    traffic = np.zeros((plan.world_size, 2, 4))
    rows = plan_rows(plan)
    for (holder, server, n), row_bytes, out_col, in_col in (
        (rows[0], plan.q_row_bytes, Q_OUT, Q_IN),
        (rows[1], plan.kv_row_bytes, KV_OUT, KV_IN),
    ):
        if link.ranks_per_node is None:
            link_class = np.full(holder.shape, INTER)
        else:
            same = holder // link.ranks_per_node == server // link.ranks_per_node
            link_class = np.where(same, INTRA, INTER)
        add_bytes(traffic, holder, link_class, out_col, n * row_bytes)
        add_bytes(traffic, server, link_class, in_col, n * row_bytes)
    return traffic


def plan_critical_path(plan: Any, link: LinkModel, loads: Any = None) -> float:
    """Seconds of one layer's core attention on the critical path under ``plan`` (``loads``: per server
    cost, default the plan's ``load_after``)."""
    loads = plan.load_after if loads is None else loads
    comm = link.comm_seconds(link.phase_seconds(plan_traffic(plan, link)))
    return link.critical_path(max(loads, default=0.0), comm)
