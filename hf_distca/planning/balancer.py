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

import numpy as np

from hf_distca.planning.assignment import ServerState
from hf_distca.planning.candidates import Move, MoveCandidates
from hf_distca.planning.cost import CausalPairsCost
from hf_distca.planning.links import LinkModel, PhaseTimes
from hf_distca.planning.options import PlannerOptions
from hf_distca.planning.pieces import DocIndex
from hf_distca.planning.tasks import CATask
from hf_distca.planning.traffic import relays
from hf_distca.planning.window import Ranges, attended_pairs

FREE_LINKS = LinkModel(math.inf, math.inf, None, 0.0, 1.0)
"""Every link free: the traffic bookkeeping of the send bound when communication is not priced."""


class Balancer(MoveCandidates):
    """The greedy over one micro-batch's servers (see the module docstring): the servers' assignment, its
    loads and (with a link model or a send bound) its exact traffic (the bytes of each move:
    :class:`~hf_distca.planning.move_bytes.MoveBytes`); which moves it considers and their price are
    :class:`~hf_distca.planning.candidates.MoveCandidates`'; :meth:`balance` moves work."""

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
        self.moves: list[Move] = []
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

    def apply(self, move: Move) -> None:
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

    def _first_move(self, src: ServerState, target: float, ranks=None) -> Move | None:
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

    def _priced_move(self, src: ServerState, target: float) -> Move | None:
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
