"""The greedy balancer: moves CA-tasks (or head/tail shards of them) from surplus to deficit servers.

While the most loaded server is above (1 + tolerance) x mean (or a given level), move work from it to the
least loaded server, choosing the move with the most cost per byte that must be communicated; a task too
large to move whole is split into a head or tail shard whose split point sits on a multiple of
``shard_tokens``. Cost is whatever the cost model returns (:mod:`hf_distca.planning.cost`).

Priced (a :class:`~hf_distca.planning.links.LinkModel`): the balancer tracks the exact bytes of every rank on
each link class (:class:`~hf_distca.planning.links.PhaseTimes`); a candidate move is allowed only when the
compute it takes off max(source, destination) exceeds the exposed transfer time it adds (its cost per byte
is netted of that time); each step compares the best move to the least loaded destination with the best
one inside the source's node and takes the larger net gain; when every move that fits a destination's
deficit is priced out, a larger shard (up to evening out the two) is tried, one KV prefix buying more
work. Which of several greedies wins is :mod:`hf_distca.planning.planner`'s business.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hf_distca.planning.assignment import ServerState
from hf_distca.planning.cost import CausalPairsCost
from hf_distca.planning.links import Changes, LinkModel, PhaseTimes
from hf_distca.planning.move_bytes import MoveBytes
from hf_distca.planning.options import PlannerOptions
from hf_distca.planning.pieces import DocIndex
from hf_distca.planning.tasks import CATask
from hf_distca.planning.traffic import relays
from hf_distca.planning.window import Ranges, attended_pairs, kv_start, ranges_minus

FREE_LINKS = LinkModel(math.inf, math.inf, None, 0.0, 1.0)
"""Every link free: the traffic bookkeeping of the send bound when communication is not priced."""


@dataclass
class _Move:
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


class Balancer(MoveBytes):
    """The greedy over one micro-batch's servers (see the module docstring): the servers' assignment, its
    loads and (with a link model or a send bound) its exact traffic (the bytes of each move:
    :class:`~hf_distca.planning.move_bytes.MoveBytes`); :meth:`balance` moves work."""

    def __init__(
        self, index: DocIndex, cost, options: PlannerOptions, link: LinkModel | None, q_row: int, kv_row: int
    ):
        self.index, self.cost, self.options, self.link = index, cost, options, link
        self.window = getattr(cost, "window", None)
        # causal pairs add up over any split of a task: a move changes src and dst by the moved shard's
        # cost; other models (measured time) price a server's merged intervals, see _load_changes
        self.additive = isinstance(cost, CausalPairsCost)
        self.q_row, self.kv_row = q_row, kv_row
        world = index.world_size
        self._index_runs(index)
        self.servers = [ServerState(r) for r in range(world)]
        self.serving: dict[int, set[int]] = {}  # doc -> servers with tasks of it
        self._owned: set[int] | None = None  # clones: the servers copied from the origin (None: all own)
        self._owned_docs: set[int] = set()
        for doc in index.doc_ids:
            for h in index.holdings[doc]:
                self.servers[h.rank].add(doc, h.doc_start, h.doc_end, self.window)
                self.serving.setdefault(doc, set()).add(h.rank)
        for s in self.servers:
            s.load = sum(cost.task_cost(a, b) for ivs in s.intervals.values() for a, b in ivs)
        self.loads = np.array([s.load for s in self.servers], dtype=np.float64)  # mirrors each s.load
        # KV through the per-node relay (hf_distca.planning.relay): its bytes are what the link prices and
        # what the send bound holds, priced or not
        self.relayed = relays(options.kv_relay, options.ranks_per_node, world)
        # exact traffic: with a link model (prices moves), or for the send bound alone (free links)
        self.traffic = None
        if link is not None or options.max_send_bytes_per_rank is not None:
            self.traffic = PhaseTimes(link or FREE_LINKS, world)
            self.traffic.apply(self._initial_traffic())
        self.moves: list[_Move] = []
        # priced: the all-to-all seconds and the critical path after 0, 1, ... moves
        self.comm: list[float] = [self.traffic.now] if link is not None else []
        self.path: list[float] = [self.critical_path()] if link is not None else []

    def assignment(self) -> tuple[list[list[CATask]], list[dict[int, Ranges]]]:
        """Per server, its tasks in canonical order (doc_id, q_start) and doc_id -> the key ranges they
        read."""
        tasks, kv = [], []
        for s in self.servers:
            tasks.append([CATask(doc, a, b) for doc in sorted(s.intervals) for a, b in s.intervals[doc]])
            kv.append({doc: s.kv(doc, self.window) for doc in sorted(s.intervals)})
        return tasks, kv

    def pairs(self) -> list[int]:
        """Per server, the (query, key) pairs of its current tasks."""
        return [
            sum(attended_pairs(a, b, self.window) for ivs in s.intervals.values() for a, b in ivs)
            for s in self.servers
        ]

    def clone(self) -> Balancer:
        """An independent copy of this state (planning again from the same start)."""
        other = object.__new__(Balancer)
        other.__dict__.update(self.__dict__)  # the inputs and the document runs are shared
        # servers and servers-of-document sets are shared until a move changes them (copy on write)
        other.servers, other.serving = list(self.servers), dict(self.serving)
        other.loads = self.loads.copy()
        other._owned, other._owned_docs = set(), set()
        other.traffic = self.traffic.clone() if self.traffic is not None else None
        other.moves, other.comm, other.path = list(self.moves), list(self.comm), list(self.path)
        return other

    def priced(self, link: LinkModel) -> Balancer:
        """A balancer from this one's start that prices moves under ``link`` (as
        ``Balancer(index, cost, options, link, ...)``, without computing the loads again); both share the
        servers until a move changes one (copy on write, on both sides). Only before any move."""
        if self.moves:
            raise AssertionError("planner bug: priced() after moves")
        other = self.clone()
        if self._owned is None:  # this one edited its servers in place so far: now it copies them first
            self._owned, self._owned_docs = set(), set()
        other.link = link
        other.traffic = PhaseTimes(link, len(self.servers))
        other.traffic.apply(other._initial_traffic())
        other.comm, other.path = [other.traffic.now], []
        other.path.append(other.critical_path())
        return other

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

    def critical_path(self) -> float:
        return self.link.critical_path(float(self.loads.max()) if self.loads.size else 0.0, self.comm[-1])

    def _own(self, rank: int, doc: int) -> ServerState:
        """Server ``rank``, copied first when it is still shared with the state this one was cloned from
        (and the same for the servers-of-``doc`` set)."""
        if self._owned is not None:
            if rank not in self._owned:
                self.servers[rank] = self.servers[rank].clone()
                self._owned.add(rank)
            if doc not in self._owned_docs:
                self.serving[doc] = set(self.serving[doc])
                self._owned_docs.add(doc)
        return self.servers[rank]

    def apply(self, move: _Move) -> None:
        src, dst = self._own(move.src, move.doc), self._own(move.dst, move.doc)
        if self.traffic is not None:
            changes = move.changes
            if changes is None:
                changes = self.changes_of(src, dst, move.doc, move.a, move.b)
            self.traffic.apply(changes)
        src_drop, dst_rise = self._load_changes(src, dst, move.doc, move.a, move.b)
        src.remove(move.doc, move.a, move.b)
        src.load -= src_drop
        if move.doc not in src.intervals:
            self.serving[move.doc].discard(src.rank)
        dst.add(move.doc, move.a, move.b, self.window)
        dst.load += dst_rise
        self.loads[src.rank], self.loads[dst.rank] = src.load, dst.load
        dst.recv_bytes += move.bytes_in
        self.serving[move.doc].add(dst.rank)
        self.moves.append(move)
        if self.link is not None:
            self.comm.append(self.traffic.now)
            self.path.append(self.critical_path())

    # ------------------------------------------------------------------------------------------ greedy
    def balance(self, level: float | None = None, give_up_above: float | None = None) -> None:
        """Move work until the most loaded server is within the tolerance of the mean (or at most
        ``level``, the load each move fills a destination up to instead of the mean). Priced: stops early
        once the exposed transfer already added keeps the critical path above the lowest seen so far (or
        ``give_up_above``)."""
        servers, options = self.servers, self.options
        total = sum(s.load for s in servers)
        if len(servers) <= 1 or total <= 0:
            return
        target = total / len(servers)
        limit = (1.0 + options.balance_tolerance) * target
        if level is not None:
            target, limit = level, max(limit, level)
        while len(self.moves) < options.max_planner_moves:
            src = servers[int(np.argmax(self.loads))]  # the most loaded, the lowest rank among equals
            if src.load <= limit:
                break
            if self.link is not None:
                # moves add transfer time: stop once even a server at the limit could not bring the
                # critical path back below the best seen (here or, given, in another plan)
                best = min(self.path) if give_up_above is None else min(give_up_above, min(self.path))
                if self.link.critical_path(limit, self.comm[-1]) > best:
                    break
            move = self._priced_move(src, target) if self.link is not None else self._first_move(src, target)
            if move is None:
                break
            self.apply(move)

    def _first_move(self, src: ServerState, target: float, ranks=None) -> _Move | None:
        """The balance-only choice: the best move to the least loaded destination (of ``ranks``, default
        all) that has one."""
        special = self._involved(src) if self.traffic is not None else None
        priced_out: set[int] = set()  # nodes of destinations the send bound turned down
        if ranks is None:
            ranks = np.argsort(self.loads, kind="stable")  # least loaded first, ties by rank
        for rank in ranks:
            dst = self.servers[rank]
            if dst.load >= target:
                break  # no room below the target here or further on
            if dst is src:
                continue
            # a destination that holds and serves nothing of src's documents is skipped once another one
            # in its node was turned down by the send bound (its moves send the same bytes)
            # (through the relay, up to the second hop inside the node, which the holder's relay there saves)
            generic = special is not None and dst.rank not in special
            if generic and self.node(dst.rank) in priced_out:
                continue
            move, rejected = self._best_move(src, dst, target)
            if move is not None:
                move.src, move.dst = src.rank, dst.rank
                return move
            if rejected and generic:
                priced_out.add(self.node(dst.rank))
        return None

    def _priced_move(self, src: ServerState, target: float) -> _Move | None:
        """The larger net gain (relief of max(src, dst) minus the exposed transfer time added) of two
        moves: to the least loaded destination that has one, and to the least loaded one in src's node
        that has one (where its KV travels over the fast links)."""
        anywhere = self._first_move(src, target)
        per = self.link.ranks_per_node
        if per is None or (anywhere is not None and self.node(anywhere.dst) == self.node(src.rank)):
            return anywhere
        first = self.node(src.rank) * per
        members = range(first, min(first + per, len(self.servers)))
        local = self._first_move(src, target, sorted(members, key=lambda r: (self.loads[r], r)))
        if anywhere is None or (local is not None and local.net > anywhere.net):
            return local
        return anywhere

    def best_prefix(self) -> int:
        """How many of the moves made lead to the lowest critical path (the most such moves)."""
        lowest = min(self.path)
        return max(k for k, value in enumerate(self.path) if value == lowest)

    def _involved(self, src: ServerState) -> set[int]:
        """Ranks that hold or serve part of a document src serves."""
        out: set[int] = set()
        for doc in src.intervals:
            out.update(h.rank for h in self.index.holdings[doc])
            out.update(self.serving[doc])
        return out

    def _best_move(self, src: ServerState, dst: ServerState, target: float) -> tuple[_Move | None, bool]:
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
                for x, y in _candidate_ranges(a, b, want, g, task_cost):
                    c = task_cost(x, y)
                    if c > 0 and dst_load + c < src_load:
                        (fitting if c <= want else overshooting).append((c, doc, x, y))
        rejected = False
        # (doc, end) of shards turned down for their price: a shorter shard with the same end reads the
        # same KV prefix for less work, and is not priced
        priced_out: set[tuple[int, int]] = set()
        substantial: list[_Move] = []
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
        cheapest: list[_Move] = []
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
                    for x, y in _candidate_ranges(a, b, half, g, task_cost):
                        move, _ = self._candidate(src, dst, doc, x, y, task_cost(x, y))
                        if move is not None:
                            larger.append(move)
            if larger:
                return max(larger, key=lambda m: (m.net, m.score, -m.doc, -m.a)), rejected
        return None, rejected

    def _candidate(
        self, src: ServerState, dst: ServerState, doc: int, x: int, y: int, c: float
    ) -> tuple[_Move | None, bool]:
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
            return _Move(doc, x, y, c, bytes_in, c / (comm + 1.0)), False
        changes = self.changes_of(src, dst, doc, x, y)
        exposed = self._exposed_increase(changes)
        relief = src.load - max(src.load - c, dst.load + dst_rise)  # how much max(src, dst) drops
        if exposed is None or exposed >= relief:
            return None, True
        # the balance-only planner's cost per byte, net of the exposed transfer time the move adds
        score = (c - exposed) / (comm + 1.0)
        return _Move(doc, x, y, c, bytes_in, score, changes, net=relief - exposed), False

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


def _candidate_ranges(a: int, b: int, want: float, g: int, task_cost) -> list[tuple[int, int]]:
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
