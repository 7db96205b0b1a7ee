"""The moves the balancer (:mod:`hf_distca.planning.balancer`) considers, and their price: the sub-ranges of a
task worth moving (whole, or a head or tail shard split on a multiple of ``shard_tokens``), the load each
server gains or loses (the shard's cost for causal pairs, the exact change of a server's merged intervals
for other cost models), the bytes the destination lacks and, priced under a link model, the exposed
transfer time a move adds against the compute it takes off max(source, destination)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hf_distca.planning.assignment import ServerState
from hf_distca.planning.links import Changes, PhaseTimes
from hf_distca.planning.move_bytes import MoveBytes
from hf_distca.planning.window import kv_start, ranges_minus

__all__ = ["Move", "MoveCandidates", "candidate_ranges"]


@dataclass
class Move:
    """Queries [a, b) of document ``doc`` from server ``src`` to ``dst``: its cost, the bytes ``dst``
    receives, its score (cost per communicated byte, net of the exposed time added when priced)."""

    doc: int
    a: int
    b: int
    cost: float
    bytes_in: int
    score: float
    changes: Changes | None = None
    net: float = 0.0
    """Priced moves: how much max(src, dst) drops minus the exposed transfer time added (cost units)."""
    src: int = -1
    dst: int = -1


class MoveCandidates(MoveBytes):
    """The candidate moves between two servers and their price, over the state
    :class:`~hf_distca.planning.balancer.Balancer` keeps; besides what :class:`MoveBytes` reads, it sets
    ``cost`` (the cost model), ``additive`` (causal pairs: a shard's cost adds up over any split),
    ``traffic`` (the exact bytes per rank and phase, or None when neither priced nor send-bounded)."""

    cost: Any
    additive: bool
    traffic: PhaseTimes | None

    def _load_changes(
        self, src: ServerState, dst: ServerState, doc: int, x: int, y: int
    ) -> tuple[float, float]:
        """(how much src's load drops, how much dst's rises) when queries [x, y) of ``doc`` move: the
        shard's cost for causal pairs; for other cost models the exact change of each server's load, whose
        tasks are its merged intervals (cutting an interval or joining two changes their measured time)."""
        cost = self.cost
        if self.additive:
            c = cost.task_cost(x, y)
            return c, c
        for a, b in src.intervals[doc]:
            if a <= x and y <= b:
                break
        else:
            raise AssertionError(f"planner bug: [{x}, {y}) of doc {doc} not on server {src.rank}")
        drop = (
            cost.task_cost(a, b)
            - (cost.task_cost(a, x) if x > a else 0.0)
            - (cost.task_cost(y, b) if b > y else 0.0)
        )
        lo, hi, joined = x, y, 0.0
        for a, b in dst.intervals.get(doc, ()):
            if b == x:
                lo, joined = a, joined + cost.task_cost(a, b)
            elif a == y:
                hi, joined = b, joined + cost.task_cost(a, b)
        return drop, cost.task_cost(lo, hi) - joined

    def _involved(self, src: ServerState) -> set[int]:
        """Ranks that hold or serve part of a document src serves."""
        out: set[int] = set()
        for doc in src.intervals:
            out.update(h.rank for h in self.index.holdings[doc])
            out.update(self.serving[doc])
        return out

    def _best_move(self, src: ServerState, dst: ServerState, target: float) -> tuple[Move | None, bool]:
        """The move from src to dst with the most cost per communicated byte among those that do a real
        share of the work dst can take (see module docstring), and whether a candidate was turned down for
        its price or the send bound. Candidates are priced lazily, largest first: one that cannot be
        chosen is never priced."""
        want = min(src.load - target, target - dst.load)
        if want <= 0:
            return None, False
        g, task_cost = self.options.shard_tokens, self.cost.task_cost
        src_load, dst_load = src.load, dst.load
        fitting, overshooting = (
            [],
            [],
        )  # (cost, doc, x, y): at most `want`, or larger but lowering max(src, dst)
        for doc, ivs in src.intervals.items():
            for a, b in ivs:
                for x, y in candidate_ranges(a, b, want, g, task_cost):
                    c = task_cost(x, y)
                    if c > 0 and dst_load + c < src_load:
                        (fitting if c <= want else overshooting).append((c, doc, x, y))
        rejected = False
        # (doc, end) of shards turned down for their price: a shorter shard with the same end reads the
        # same KV prefix for less work, and is not priced
        priced_out: set[tuple[int, int]] = set()
        substantial: list[Move] = []
        for c, doc, x, y in sorted(fitting, key=lambda m: -m[0]):
            if substantial and c < 0.5 * substantial[0].cost:
                break  # cheaper than half the largest allowed move
            if (doc, y) in priced_out:
                continue
            move, turned_down = self._candidate(src, dst, doc, x, y, c)
            rejected |= turned_down
            if turned_down:
                priced_out.add((doc, y))
            if move is not None:
                substantial.append(move)
        if substantial:
            # among moves that do a real share of the wanted work, the most cost per byte
            return max(substantial, key=lambda m: (m.score, m.cost, -m.doc, -m.a)), rejected
        cheapest: list[Move] = []
        for c, doc, x, y in sorted(overshooting, key=lambda m: m[0]):
            if cheapest and c > cheapest[0].cost:
                break
            if (doc, y) in priced_out:
                continue
            move, turned_down = self._candidate(src, dst, doc, x, y, c)
            rejected |= turned_down
            if move is not None:
                cheapest.append(move)
        if cheapest:
            return min(cheapest, key=lambda m: (m.cost, -m.score, m.doc, m.a)), rejected
        if rejected and self.link is not None:
            # every move that fits dst's deficit costs more transfer time than it saves: a larger shard
            # (up to evening out src and dst) pays the same KV prefix for more work; take the best net gain
            half = (src.load - dst.load) / 2
            larger = []
            for doc, ivs in src.intervals.items():
                for a, b in ivs:
                    for x, y in candidate_ranges(a, b, half, g, task_cost):
                        move, _ = self._candidate(src, dst, doc, x, y, task_cost(x, y))
                        if move is not None:
                            larger.append(move)
            if larger:
                return max(larger, key=lambda m: (m.net, m.score, -m.doc, -m.a)), rejected
        return None, rejected

    def _candidate(
        self, src: ServerState, dst: ServerState, doc: int, x: int, y: int, c: float
    ) -> tuple[Move | None, bool]:
        """Moving queries [x, y) of ``doc`` (cost ``c``) from src to dst, priced and scored; None when it is
        not allowed (or does not lower max(src, dst)), with whether its price or the send bound turned it
        down."""
        if c <= 0:
            return None, False
        src_drop, dst_rise = (c, c) if self.additive else self._load_changes(src, dst, doc, x, y)
        if src_drop <= 0 or dst.load + dst_rise >= src.load:
            return None, False
        c = src_drop
        q_row, kv_row = self.q_row, self.kv_row
        q_in = (y - x) - self.rows_held(dst.rank, doc, x, y)  # rows dst lacks
        if self.window is None:
            have = dst.kv_need.get(doc, 0)
            kv_in = (y - have) - self.rows_held(dst.rank, doc, have, y) if y > have else 0
        else:
            lacking = ranges_minus([(kv_start(x, self.window), y)], dst.given(doc, self.window))
            kv_in = sum((hi - lo) - self.rows_held(dst.rank, doc, lo, hi) for lo, hi in lacking)
        bytes_in = q_in * q_row + kv_in * kv_row
        bound = self.options.max_recv_bytes_per_server
        if bound is not None and dst.recv_bytes + bytes_in > bound:
            return None, False
        comm = bytes_in + q_in * q_row  # outputs travel back
        if self.traffic is None:
            return Move(doc, x, y, c, bytes_in, c / (comm + 1.0)), False
        changes = self.changes_of(src, dst, doc, x, y)
        exposed = self._exposed_increase(changes)
        relief = src.load - max(src.load - c, dst.load + dst_rise)  # how much max(src, dst) drops
        if exposed is None or exposed >= relief:
            return None, True
        # the balance-only planner's cost per byte, net of the exposed transfer time the move adds
        score = (c - exposed) / (comm + 1.0)
        return Move(doc, x, y, c, bytes_in, score, changes, net=relief - exposed), False

    def _exposed_increase(self, changes: Changes) -> float | None:
        """Exposed transfer time ``changes`` add to the step, in cost units; None when a rank would go over
        the send bound."""
        traffic = self.traffic
        bound = self.options.max_send_bytes_per_rank
        if len(changes) >= traffic.MANY:
            added = traffic.exposed_many(changes, bound)
            if added is None:
                return None
            if self.link is None:
                return 0.0
            return self._exposed_seconds(added) / self.link.seconds_per_cost_unit
        after = traffic.after(changes)
        if bound is not None:
            for r, b in after.items():
                sent = traffic.sent(b)
                if sent > bound and sent > traffic.sent(traffic.bytes[r]):
                    return None
        if self.link is None:
            return 0.0
        new_phases = {r: traffic.rank_phases(b) for r, b in after.items()}
        added = traffic.comm_seconds(new_phases) - traffic.now
        return self._exposed_seconds(added) / self.link.seconds_per_cost_unit

    def _exposed_seconds(self, added: float) -> float:
        """Exposed transfer seconds that ``added`` seconds of transfer add to the current ones (the link
        model's :meth:`~hf_distca.planning.links.LinkModel.exposed`)."""
        now = self.traffic.now
        return self.link.exposed(now + added) - self.link.exposed(now)


def candidate_ranges(a: int, b: int, want: float, g: int, task_cost) -> list[tuple[int, int]]:
    """Sub-ranges of task [a, b) worth moving (``task_cost``: the cost model's): whole, the largest tail
    and head shards costing at most ``want``, and the smallest tail/head shards (for when every fitting
    shard is empty)."""
    first = (a // g + 1) * g  # first split point strictly inside (a, b)
    if first >= b:
        return [(a, b)]
    n = (b - 1 - first) // g + 1  # split points first + i g, i < n, on multiples of g
    last = first + (n - 1) * g
    out = [(a, b)]
    # tail [c, b): cost decreases as c grows; smallest c with cost <= want
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if task_cost(first + mid * g, b) <= want:
            hi = mid
        else:
            lo = mid + 1
    if lo < n:
        out.append((first + lo * g, b))
    out.append((last, b))
    # head [a, c): cost grows with c; largest c with cost <= want
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if task_cost(a, first + mid * g) <= want:
            lo = mid + 1
        else:
            hi = mid
    if lo > 0:
        out.append((a, first + (lo - 1) * g))
    out.append((a, first))
    return list(dict.fromkeys(out))
