"""plan_core_attention: cut core attention into CA-tasks and balance them over attention servers.

Pure Python/NumPy. Every rank calls it with the same all-gathered pieces and gets the same plan, so
no plan is ever broadcast. Greedy: while the most loaded server is above (1 + tolerance) x mean,
move work from it to the least loaded server, choosing the move with the most cost per byte that
must be communicated; a task too large to move whole is split into a head or tail shard whose split
point sits on a multiple of ``shard_tokens``. Cost is whatever the cost model returns (causal
(query, key) pairs by default; see :mod:`hf_distca.planning.cost`).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from hf_distca.config import DistCAConfig
from hf_distca.planning.cost import CausalPairsCost, causal_pairs
from hf_distca.planning.pieces import DocIndex


@dataclass(frozen=True, order=True)
class CATask:
    """Queries [q_start, q_end) of one document, attending causally to its KV prefix [0, q_end)."""

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
    kv_prefix: list[dict[int, int]]
    """Per server: doc_id -> length of the KV prefix of that document the server needs."""
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
    bytes_sent: list[int] = field(default_factory=list)
    """Per rank: bytes it sends in one forward call (Q and KV out, outputs back)."""
    bytes_received: list[int] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return len(self.tasks)

    @property
    def imbalance_before(self) -> float:
        return _imbalance(self.load_before)

    @property
    def imbalance_after(self) -> float:
        return _imbalance(self.load_after)

    def digest(self) -> str:
        """A hash of the assignment; identical on every rank that planned the same inputs."""
        h = hashlib.sha256()
        for server, tasks in enumerate(self.tasks):
            h.update(f"{server}:".encode())
            for t in tasks:
                h.update(f"{t.doc_id},{t.q_start},{t.q_end};".encode())
        return h.hexdigest()


def _imbalance(loads: Sequence[float]) -> float:
    mean = sum(loads) / max(len(loads), 1)
    return max(loads) / mean if mean > 0 else 1.0


class _Server:
    """Mutable planning state of one server."""

    __slots__ = ("rank", "intervals", "load", "kv_need", "recv_bytes")

    def __init__(self, rank: int):
        self.rank = rank
        self.intervals: dict[int, list[list[int]]] = {}  # doc -> sorted [a, b) query intervals
        self.load = 0.0
        self.kv_need: dict[int, int] = {}  # doc -> KV prefix length needed
        self.recv_bytes = 0

    def add(self, doc: int, a: int, b: int) -> None:
        ivs = self.intervals.setdefault(doc, [])
        i = bisect.bisect_left(ivs, [a, b])
        ivs.insert(i, [a, b])
        # merge with neighbours that touch
        if i + 1 < len(ivs) and ivs[i][1] == ivs[i + 1][0]:
            ivs[i][1] = ivs[i + 1][1]
            del ivs[i + 1]
        if i > 0 and ivs[i - 1][1] == ivs[i][0]:
            ivs[i - 1][1] = ivs[i][1]
            del ivs[i]
        self.kv_need[doc] = max(self.kv_need.get(doc, 0), b)

    def remove(self, doc: int, a: int, b: int) -> None:
        ivs = self.intervals[doc]
        for i, (x, y) in enumerate(ivs):
            if x <= a and b <= y:
                rest = [iv for iv in ([x, a], [b, y]) if iv[1] > iv[0]]
                ivs[i : i + 1] = rest
                if not ivs:
                    del self.intervals[doc]
                return
        raise AssertionError(f"planner bug: [{a}, {b}) of doc {doc} not on server {self.rank}")


@dataclass
class _Move:
    doc: int
    a: int
    b: int
    cost: float
    bytes_in: int
    score: float


def plan_core_attention(
    pieces_per_rank: Sequence[Sequence[Sequence[int]]],
    *,
    q_row_bytes: int,
    kv_row_bytes: int,
    config: DistCAConfig | None = None,
    cost_model=None,
) -> CorePlan:
    """Plan one micro-batch's core attention over ``len(pieces_per_rank)`` in-place servers.

    pieces_per_rank[r]: rank r's pieces ``(doc_id, doc_start, length)`` in local order.
    q_row_bytes: bytes of one token's queries (heads x head_dim x element size); the same for outputs.
    kv_row_bytes: bytes of one token's keys plus values.
    cost_model: object with ``task_cost(a, b)``; default :class:`CausalPairsCost` (causal (query, key)
    pairs). :func:`hf_distca.planning.cost.cost_model_from_config` gives the one a config asks for.
    """
    config = config or DistCAConfig()
    cost = cost_model or CausalPairsCost()
    index = DocIndex(pieces_per_rank)
    world = index.world_size
    servers = [_Server(r) for r in range(world)]
    for doc in index.doc_ids:
        for h in index.holdings[doc]:
            servers[h.rank].add(doc, h.doc_start, h.doc_end)
    for s in servers:
        s.load = sum(cost.task_cost(a, b) for ivs in s.intervals.values() for a, b in ivs)
    load_before = [s.load for s in servers]
    pairs_before = [sum(causal_pairs(a, b) for ivs in s.intervals.values() for a, b in ivs) for s in servers]

    moves = 0
    total = sum(load_before)
    if world > 1 and total > 0:
        mean = total / world
        limit = (1.0 + config.tolerance) * mean
        while moves < config.max_planner_moves:
            src = max(servers, key=lambda s: (s.load, -s.rank))
            if src.load <= limit:
                break
            move = None
            for dst in sorted(servers, key=lambda s: (s.load, s.rank)):
                if dst is src or dst.load >= src.load:
                    break
                move = _best_move(src, dst, mean, index, cost, config, q_row_bytes, kv_row_bytes)
                if move is not None:
                    break
            if move is None:
                break
            src.remove(move.doc, move.a, move.b)
            src.load -= move.cost
            dst.add(move.doc, move.a, move.b)
            dst.load += move.cost
            dst.recv_bytes += move.bytes_in
            moves += 1

    tasks, kv_prefix = [], []
    for s in servers:
        ts = [CATask(doc, a, b) for doc in sorted(s.intervals) for a, b in s.intervals[doc]]
        tasks.append(ts)
        need: dict[int, int] = {}
        for t in ts:
            need[t.doc_id] = max(need.get(t.doc_id, 0), t.q_end)
        kv_prefix.append(need)
    load_after = [sum(cost.task_cost(t.q_start, t.q_end) for t in ts) for ts in tasks]
    pairs_after = [sum(causal_pairs(t.q_start, t.q_end) for t in ts) for ts in tasks]
    plan = CorePlan(
        index=index,
        tasks=tasks,
        kv_prefix=kv_prefix,
        load_before=load_before,
        load_after=load_after,
        pairs_before=pairs_before,
        pairs_after=pairs_after,
        q_row_bytes=q_row_bytes,
        kv_row_bytes=kv_row_bytes,
        moves=moves,
    )
    plan.bytes_sent, plan.bytes_received = _traffic(plan)
    return plan


def _best_move(src, dst, mean, index, cost, config, q_row_bytes, kv_row_bytes) -> _Move | None:
    """The move from src to dst with the most cost per communicated byte (see module docstring)."""
    want = min(src.load - mean, mean - dst.load)
    if want <= 0:
        return None
    g = config.shard_tokens
    bound = config.max_recv_bytes_per_server
    fitting: list[_Move] = []  # moves of at most `want`
    overshooting: list[_Move] = []  # moves that still lower max(src, dst)
    for doc, ivs in src.intervals.items():
        for a, b in ivs:
            for x, y in _candidate_ranges(a, b, want, g, cost):
                c = cost.task_cost(x, y)
                if c <= 0:
                    continue
                if dst.load + c >= src.load:
                    continue
                q_in = (y - x) - index.count_held_by(doc, x, y, dst.rank)
                have = dst.kv_need.get(doc, 0)
                kv_in = 0
                if y > have:
                    kv_in = (y - have) - index.count_held_by(doc, have, y, dst.rank)
                bytes_in = q_in * q_row_bytes + kv_in * kv_row_bytes
                if bound is not None and dst.recv_bytes + bytes_in > bound:
                    continue
                comm = bytes_in + q_in * q_row_bytes  # outputs travel back
                move = _Move(doc, x, y, c, bytes_in, c / (comm + 1.0))
                (fitting if c <= want else overshooting).append(move)
    if fitting:
        largest = max(m.cost for m in fitting)
        # among moves that do a real share of the wanted work, take the most cost per byte
        substantial = [m for m in fitting if m.cost >= 0.5 * largest]
        return max(substantial, key=lambda m: (m.score, m.cost, -m.doc, -m.a))
    if overshooting:
        return min(overshooting, key=lambda m: (m.cost, -m.score, m.doc, m.a))
    return None


def _candidate_ranges(a: int, b: int, want: float, g: int, cost) -> list[tuple[int, int]]:
    """Sub-ranges of task [a, b) worth moving: whole, the largest tail and head shards costing at most
    ``want``, and the smallest tail/head shards (for when every fitting shard is empty)."""
    out = [(a, b)]
    first = (a // g + 1) * g  # first split point strictly inside (a, b)
    if first >= b:
        return out
    cuts = range(first, b, g)  # split points on multiples of g
    # tail [c, b): cost decreases as c grows; smallest c with cost <= want
    lo, hi = 0, len(cuts)
    while lo < hi:
        mid = (lo + hi) // 2
        if cost.task_cost(cuts[mid], b) <= want:
            hi = mid
        else:
            lo = mid + 1
    if lo < len(cuts):
        out.append((cuts[lo], b))
    out.append((cuts[-1], b))
    # head [a, c): cost grows with c; largest c with cost <= want
    lo, hi = 0, len(cuts)
    while lo < hi:
        mid = (lo + hi) // 2
        if cost.task_cost(a, cuts[mid]) <= want:
            lo = mid + 1
        else:
            hi = mid
    if lo > 0:
        out.append((a, cuts[lo - 1]))
    out.append((a, cuts[0]))
    return list(dict.fromkeys(out))


def _traffic(plan: CorePlan) -> tuple[list[int], list[int]]:
    """Bytes each rank sends and receives in one forward call of the engine under ``plan``."""
    world = plan.world_size
    sent = [0] * world
    recv = [0] * world
    index = plan.index
    for server in range(world):
        for t in plan.tasks[server]:
            for holder, _, n in index.segments(t.doc_id, t.q_start, t.q_end):
                if holder != server:
                    b = n * plan.q_row_bytes
                    sent[holder] += b  # Q out
                    recv[server] += b
                    sent[server] += b  # output back
                    recv[holder] += b
        for doc, prefix in plan.kv_prefix[server].items():
            for holder, _, n in index.segments(doc, 0, prefix):
                if holder != server:
                    b = n * plan.kv_row_bytes
                    sent[holder] += b
                    recv[server] += b
    return sent, recv
