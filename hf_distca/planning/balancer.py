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

import bisect
import math
from dataclasses import dataclass

import numpy as np

from hf_distca.planning.cost import CausalPairsCost
from hf_distca.planning.links import Changes, LinkModel, PhaseTimes
from hf_distca.planning.options import PlannerOptions
from hf_distca.planning.pieces import DocIndex
from hf_distca.planning.relay import relay_rank
from hf_distca.planning.tasks import CATask, key_range_requests
from hf_distca.planning.traffic import (
    INTER,
    INTRA,
    KV_IN,
    KV_OUT,
    Q_IN,
    Q_OUT,
    kv_ranges_relay_traffic,
    relays,
    rows_traffic,
)
from hf_distca.planning.window import Ranges, attended_pairs, kv_ranges, kv_start, ranges_minus, ranges_union

FREE_LINKS = LinkModel(math.inf, math.inf, None, 0.0, 1.0)
"""Every link free: the traffic bookkeeping of the send bound when communication is not priced."""


class _Server:
    """Mutable planning state of one server."""

    __slots__ = ("rank", "intervals", "load", "kv_need", "kv_given", "recv_bytes")

    def __init__(self, rank: int):
        self.rank = rank
        self.intervals: dict[
            int, list[list[int]]
        ] = {}  # doc -> sorted, disjoint, merged [a, b) query intervals
        self.load = 0.0
        self.kv_need: dict[
            int, int
        ] = {}  # doc -> longest KV prefix this server was ever given (move scoring)
        self.kv_given: dict[int, Ranges] = {}  # with a window: doc -> every key range it was ever given
        self.recv_bytes = 0

    def clone(self) -> _Server:
        other = _Server(self.rank)
        other.intervals = {doc: [iv[:] for iv in ivs] for doc, ivs in self.intervals.items()}
        other.load, other.kv_need, other.recv_bytes = self.load, dict(self.kv_need), self.recv_bytes
        other.kv_given = dict(self.kv_given)  # add() replaces a document's ranges, never edits them
        return other

    def need(self, doc: int) -> int:
        """The KV prefix of ``doc`` the server's current tasks read: the end of its last interval."""
        ivs = self.intervals.get(doc)
        return ivs[-1][1] if ivs else 0

    def need_without(self, doc: int, a: int, b: int) -> int:
        """:meth:`need` once [a, b) (inside one interval) is removed."""
        ivs = self.intervals[doc]
        last = ivs[-1]
        if b < last[1] or a < last[0]:  # not the tail of the last interval
            return last[1]
        if a > last[0]:
            return a
        return ivs[-2][1] if len(ivs) > 1 else 0

    def kv(self, doc: int, window: int | None) -> Ranges:
        """The key ranges of ``doc`` the server's current tasks read."""
        ivs = self.intervals.get(doc)
        if not ivs:
            return []
        return [(0, ivs[-1][1])] if window is None else kv_ranges(ivs, window)

    def given(self, doc: int, window: int | None) -> Ranges:
        """Every key range of ``doc`` the server was ever given (move scoring)."""
        if window is None:
            have = self.kv_need.get(doc, 0)
            return [(0, have)] if have else []
        return self.kv_given.get(doc, [])

    def add(self, doc: int, a: int, b: int, window: int | None = None) -> None:
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
        if window is not None:
            self.kv_given[doc] = ranges_union(self.kv_given.get(doc, []), [(kv_start(a, window), b)])

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
    changes: Changes | None = None
    net: float = 0.0
    """Priced moves: how much max(src, dst) drops minus the exposed transfer time added (cost units)."""
    src: int = -1
    dst: int = -1


class Balancer:
    """The greedy over one micro-batch's servers (see the module docstring): the servers' assignment, its
    loads and (with a link model or a send bound) its exact traffic; :meth:`balance` moves work."""

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
        # per document, (start, end, holder) of its runs in position order
        self.runs = {
            doc: [(h.doc_start, h.doc_end, h.rank) for h in hs] for doc, hs in index.holdings.items()
        }
        self.run_ends = {doc: [b for _, b, _ in runs] for doc, runs in self.runs.items()}  # for bisect
        self.held: dict[int, dict[int, list[tuple[int, int]]]] = {}  # doc -> rank -> its runs (a, b)
        for doc, runs in self.runs.items():
            for a, b, rank in runs:
                self.held.setdefault(doc, {}).setdefault(rank, []).append((a, b))
        self.servers = [_Server(r) for r in range(world)]
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

    def _initial_traffic(self) -> Changes:
        """Bytes of the start (every server its own pieces): each server's KV prefixes from their holders."""
        kv = [{doc: s.kv(doc, self.window) for doc in s.intervals} for s in self.servers]
        if self.relayed:
            total = kv_ranges_relay_traffic(kv, self.index, self.kv_row, self.options.ranks_per_node)
        else:
            docs, starts, ends, servers = key_range_requests(kv)
            request, holder, rows = self.index.segment_rows(docs, starts, ends)
            server = np.asarray(servers, dtype=np.int64)[request]
            remote = holder != server
            no_queries = tuple(np.zeros(0, dtype=np.int64) for _ in range(3))
            per = self.link.ranks_per_node if self.link is not None else None
            kv_rows = (holder[remote], server[remote], rows[remote])
            # rank x link class x column
            total = rows_traffic(self.index.world_size, no_queries, kv_rows, self.q_row, self.kv_row, per)
        return {
            int(r): [total[r, INTRA].tolist(), total[r, INTER].tolist()]
            for r in np.flatnonzero(total.any(axis=(1, 2)))
        }

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

    # ------------------------------------------------------------------------------------ bookkeeping
    def segments(self, doc: int, start: int, end: int) -> list[tuple[int, int]]:
        """(holder, rows) of doc positions [start, end), in position order."""
        out = []
        runs = self.runs[doc]
        for i in range(bisect.bisect_right(self.run_ends[doc], start), len(runs)):
            a, b, rank = runs[i]  # the first run ending after start, then on
            if a >= end:
                break
            out.append((rank, min(end, b) - max(start, a)))
        return out

    def rows_held(self, rank: int, doc: int, start: int, end: int) -> int:
        """How many of doc positions [start, end) ``rank`` holds (its own runs: one or two, usually)."""
        return sum(max(0, min(end, b) - max(start, a)) for a, b in self.held[doc].get(rank, ()))

    def node(self, rank: int) -> int:
        per = self.link.ranks_per_node if self.link is not None else None
        return rank // per if per else 0

    def _add_segments(
        self,
        changes: Changes,
        segments: list[tuple[int, int]],
        server: int,
        col_out: int,
        col_in: int,
        row_bytes: int,
    ) -> None:
        """Add to ``changes`` the bytes of ``server`` receiving ``row_bytes`` (negative: no longer receiving)
        per row of ``segments`` (holder, rows) from their holders, on the link class of each pair."""
        per = self.link.ranks_per_node if self.link is not None else None
        node = server // per if per is not None else None
        for h, n in segments:
            if h == server:
                continue
            c = INTER if per is None else (h // per != node) * 1  # link_classes(h, server, per)
            nbytes = n * row_bytes
            row = changes.get(h)
            if row is None:
                row = changes[h] = [[0.0] * 4, [0.0] * 4]
            row[c][col_out] += nbytes
            row = changes.get(server)
            if row is None:
                row = changes[server] = [[0.0] * 4, [0.0] * 4]
            row[c][col_in] += nbytes

    def changes_of(self, src: _Server, dst: _Server, doc: int, x: int, y: int) -> Changes:
        """Byte deltas of moving queries [x, y) of ``doc`` from ``src`` to ``dst`` (integers: exact in any
        order of addition)."""
        changes: Changes = {}
        segments, add = self.segments, self._add_segments
        moved = segments(doc, x, y)
        add(changes, moved, src.rank, Q_OUT, Q_IN, -self.q_row)
        add(changes, moved, dst.rank, Q_OUT, Q_IN, self.q_row)
        added, freed = self.kv_added(dst, doc, x, y), self.kv_freed(src, doc, x, y)
        if self.relayed:
            self._relay_changes(changes, src, dst, doc, added, freed)
            return changes
        for lo, hi in added:
            add(changes, segments(doc, lo, hi), dst.rank, KV_OUT, KV_IN, self.kv_row)
        for lo, hi in freed:
            add(changes, segments(doc, lo, hi), src.rank, KV_OUT, KV_IN, -self.kv_row)
        return changes

    def _prefix_after(self, rank: int, doc: int, after: dict[int, Ranges]) -> int:
        """The end of the KV prefix of ``doc`` server ``rank`` reads once a move gives the servers in
        ``after`` those key ranges (prefixes: no window)."""
        if rank in after:
            return after[rank][-1][1] if after[rank] else 0
        return self.servers[rank].need(doc)

    def _relay_changes(
        self, changes: Changes, src: _Server, dst: _Server, doc: int, added: Ranges, freed: Ranges
    ) -> None:
        """KV byte deltas through the relay of ``dst`` reading ``added`` and ``src`` no longer reading
        ``freed``: a node's rows cross (holder to its relay in the node) once for all its servers, so the
        first stage changes by what the node's union of key ranges gains or loses; the second stage (or a
        holder inside the node, directly) sends each server its own ranges."""
        n, window = self.options.ranks_per_node, self.window

        def pair(sender: int, receiver: int, nbytes: float) -> None:
            c = INTER if sender // n != receiver // n else INTRA
            for rank, col in ((sender, KV_OUT), (receiver, KV_IN)):
                row = changes.get(rank)
                if row is None:
                    row = changes[rank] = [[0.0] * 4, [0.0] * 4]
                row[c][col] += nbytes

        after = {
            dst.rank: ranges_union(dst.kv(doc, window), added),
            src.rank: ranges_minus(src.kv(doc, window), freed),
        }
        serving = self.serving[doc]
        for node in {src.rank // n, dst.rank // n}:
            members = [r for r in range(node * n, node * n + n) if r in serving or r in after]
            if window is None:  # prefixes: a union is the longest of them
                before_end = max((self.servers[r].need(doc) for r in members), default=0)
                after_end = max((self._prefix_after(r, doc, after) for r in members), default=0)
                before_union = [(0, before_end)] if before_end else []
                after_union = [(0, after_end)] if after_end else []
            else:
                before_union, after_union = [], []
                for r in members:
                    now = self.servers[r].kv(doc, window)
                    before_union = ranges_union(before_union, now)
                    after_union = ranges_union(after_union, after.get(r, now))
            for ranges, sign in (
                (ranges_minus(after_union, before_union), 1.0),
                (ranges_minus(before_union, after_union), -1.0),
            ):
                for lo, hi in ranges:
                    for h, rows in self.segments(doc, lo, hi):
                        if h // n != node:  # crosses once, to the holder's relay in the node
                            pair(h, relay_rank(h, node, n), sign * rows * self.kv_row)
        for server, ranges, sign in ((dst.rank, added, 1.0), (src.rank, freed, -1.0)):
            for lo, hi in ranges:
                for h, rows in self.segments(doc, lo, hi):
                    sender = h if h // n == server // n else relay_rank(h, server // n, n)
                    if sender != server:
                        pair(sender, server, sign * rows * self.kv_row)

    def kv_added(self, dst: _Server, doc: int, x: int, y: int) -> Ranges:
        """Key ranges ``dst`` starts reading when it takes queries [x, y) of ``doc``."""
        if self.window is None:
            have = dst.need(doc)
            return [(have, y)] if y > have else []
        return ranges_minus([(kv_start(x, self.window), y)], dst.kv(doc, self.window))

    def kv_freed(self, src: _Server, doc: int, x: int, y: int) -> Ranges:
        """Key ranges ``src`` stops reading when queries [x, y) of ``doc`` leave it."""
        if self.window is None:
            before, after = src.need(doc), src.need_without(doc, x, y)
            return [(after, before)] if after < before else []
        rest = []
        for a, b in src.intervals[doc]:
            if a <= x and y <= b:
                rest += [iv for iv in ([a, x], [y, b]) if iv[1] > iv[0]]
            else:
                rest.append([a, b])
        return ranges_minus(src.kv(doc, self.window), kv_ranges(rest, self.window))

    def _load_changes(self, src: _Server, dst: _Server, doc: int, x: int, y: int) -> tuple[float, float]:
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

    def _own(self, rank: int, doc: int) -> _Server:
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

    def _first_move(self, src: _Server, target: float, ranks=None) -> _Move | None:
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

    def _priced_move(self, src: _Server, target: float) -> _Move | None:
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

    def _involved(self, src: _Server) -> set[int]:
        """Ranks that hold or serve part of a document src serves."""
        out: set[int] = set()
        for doc in src.intervals:
            out.update(h.rank for h in self.index.holdings[doc])
            out.update(self.serving[doc])
        return out

    def _best_move(self, src: _Server, dst: _Server, target: float) -> tuple[_Move | None, bool]:
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
        self, src: _Server, dst: _Server, doc: int, x: int, y: int, c: float
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
