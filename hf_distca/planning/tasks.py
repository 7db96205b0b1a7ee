"""CA-tasks and the plan of one micro-batch: what :func:`~hf_distca.planning.plan_core_attention` returns."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from hf_distca.planning.pieces import DocIndex
from hf_distca.planning.window import Ranges


@dataclass(frozen=True, order=True)
class CATask:
    """Queries [q_start, q_end) of one document, attending causally to its KV prefix [0, q_end) (under a
    sliding window W, to keys [max(0, q_start - W + 1), q_end): :mod:`hf_distca.planning.window`)."""

    doc_id: int
    q_start: int
    q_end: int

    @property
    def q_len(self) -> int:
        return self.q_end - self.q_start


@dataclass
class CorePlan:
    """The assignment of CA-tasks to servers for one micro-batch (shared by every layer)."""

    index: DocIndex
    tasks: list[list[CATask]]
    """Per server, its tasks in canonical order (doc_id, q_start); the kernel runs them in this order."""
    kv_ranges: list[dict[int, Ranges]]
    """Per server: doc_id -> the key positions of that document its tasks read, as sorted disjoint
    [lo, hi) ranges (without a window one range, the KV prefix [0, end of its last task))."""
    load_before: list[float]
    """Per server: cost of attention it would compute with no balancing (its own pieces)."""
    load_after: list[float]
    """Per server: cost of the tasks assigned to it."""
    pairs_before: list[int]
    """Per server: causal (query, key) pairs of its own pieces (``load_before`` in pairs, whatever the
    cost model; times 4 x heads x head_dim gives forward FLOPs)."""
    pairs_after: list[int]
    """Per server: causal (query, key) pairs of the tasks assigned to it."""
    q_row_bytes: int
    kv_row_bytes: int
    moves: int = 0
    balance_level: float | None = None
    """Priced plans: the load (cost units) moves filled destinations up to when that gave a lower critical
    path than balancing to the mean; None: the mean."""
    critical_path_before: float | None = None
    """Seconds of one layer's core attention (forward+backward) on the step's critical path with every
    rank computing its own pieces, under the link model (:mod:`hf_distca.planning.links`); None when
    communication is not priced (``DistCAConfig.link_gib_per_s`` None)."""
    critical_path_after: float | None = None
    """The same under this plan; never above ``critical_path_before``."""
    bytes_sent: list[int] = field(default_factory=list)
    """Per rank: bytes it sends in one forward call (Q and KV out, outputs back)."""
    bytes_received: list[int] = field(default_factory=list)
    window: int | None = None
    """The layer's sliding window (None: full causal), which the tasks' key ranges and pairs follow."""

    @property
    def world_size(self) -> int:
        return len(self.tasks)

    @property
    def kv_prefix(self) -> list[dict[int, int]]:
        """Per server: doc_id -> the end of the last key range it reads (the KV prefix without a window)."""
        return [{doc: ranges[-1][1] for doc, ranges in per.items()} for per in self.kv_ranges]

    @property
    def imbalance_before(self) -> float:
        return imbalance(self.load_before)

    @property
    def imbalance_after(self) -> float:
        return imbalance(self.load_after)

    def digest(self) -> str:
        """A hash of the assignment; identical on every rank that planned the same inputs."""
        h = hashlib.sha256()
        if self.window is not None:
            h.update(f"window={self.window};".encode())
        for server, tasks in enumerate(self.tasks):
            h.update(f"{server}:".encode())
            for t in tasks:
                h.update(f"{t.doc_id},{t.q_start},{t.q_end};".encode())
        return h.hexdigest()


def key_range_requests(
    kv_ranges: Sequence[dict[int, Ranges]],
) -> tuple[list[int], list[int], list[int], list[int]]:
    """``(docs, starts, ends, servers)``: every server's key ranges (``CorePlan.kv_ranges``: per server, doc
    -> ranges) one after the other, in server order, as :meth:`DocIndex.segment_rows` takes requests."""
    docs, starts, ends, servers = [], [], [], []
    for server, per_doc in enumerate(kv_ranges):
        for doc, ranges in per_doc.items():
            for lo, hi in ranges:
                docs.append(doc)
                starts.append(lo)
                ends.append(hi)
                servers.append(server)
    return docs, starts, ends, servers


def imbalance(loads: Sequence[float]) -> float:
    """Most loaded over the mean (1.0 for no loads or no work)."""
    mean = sum(loads) / max(len(loads), 1)
    return max(loads) / mean if mean > 0 else 1.0
