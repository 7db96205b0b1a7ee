"""The traffic bookkeeping of the balancer (:mod:`hf_distca.planning.balancer`): the exact bytes a move of
queries from one server to another changes, per rank, link class and ledger column (the traffic ledger's
forward dispatch, :mod:`hf_distca.planning.traffic`), directly or through the per-node KV relay
(:mod:`hf_distca.planning.relay`); and the bytes of the start, every server its own pieces. Integers
throughout, so sums are exact in any order."""

from __future__ import annotations

import bisect

import numpy as np

from hf_distca.planning.assignment import ServerState
from hf_distca.planning.links import Changes, LinkModel
from hf_distca.planning.options import PlannerOptions
from hf_distca.planning.pieces import DocIndex
from hf_distca.planning.relay import relay_rank
from hf_distca.planning.tasks import key_range_requests
from hf_distca.planning.traffic import (
    INTER,
    INTRA,
    KV_IN,
    KV_OUT,
    Q_IN,
    Q_OUT,
    kv_ranges_relay_traffic,
    rows_traffic,
)
from hf_distca.planning.window import Ranges, kv_ranges, kv_start, ranges_minus, ranges_union

__all__ = ["MoveBytes"]


class MoveBytes:
    """Byte deltas of moves over the assignment of :class:`~hf_distca.planning.balancer.Balancer`, which
    sets what they read: ``index``, ``servers`` (:class:`ServerState` per rank), ``serving`` (doc -> the
    servers with tasks of it), ``link`` (its ``ranks_per_node``, or None), ``options``, ``window``,
    ``q_row`` / ``kv_row`` (bytes per row) and ``relayed`` (KV through the relay); :meth:`_index_runs`
    sets where every document's rows are."""

    index: DocIndex
    servers: list[ServerState]
    serving: dict[int, set[int]]
    link: LinkModel | None
    options: PlannerOptions
    window: int | None
    q_row: int
    kv_row: int
    relayed: bool

    def _index_runs(self, index: DocIndex) -> None:
        """Where each document's rows are: per document, (start, end, holder) of its runs in position order,
        their ends (for bisect), and doc -> rank -> its runs (a, b)."""
        self.runs = {
            doc: [(h.doc_start, h.doc_end, h.rank) for h in hs] for doc, hs in index.holdings.items()
        }
        self.run_ends = {doc: [b for _, b, _ in runs] for doc, runs in self.runs.items()}  # for bisect
        self.held: dict[int, dict[int, list[tuple[int, int]]]] = {}  # doc -> rank -> its runs (a, b)
        for doc, runs in self.runs.items():
            for a, b, rank in runs:
                self.held.setdefault(doc, {}).setdefault(rank, []).append((a, b))

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

    def changes_of(self, src: ServerState, dst: ServerState, doc: int, x: int, y: int) -> Changes:
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
        self, changes: Changes, src: ServerState, dst: ServerState, doc: int, added: Ranges, freed: Ranges
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

    def kv_added(self, dst: ServerState, doc: int, x: int, y: int) -> Ranges:
        """Key ranges ``dst`` starts reading when it takes queries [x, y) of ``doc``."""
        if self.window is None:
            have = dst.need(doc)
            return [(have, y)] if y > have else []
        return ranges_minus([(kv_start(x, self.window), y)], dst.kv(doc, self.window))

    def kv_freed(self, src: ServerState, doc: int, x: int, y: int) -> Ranges:
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
