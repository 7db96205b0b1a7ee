"""One server's part of an assignment while the balancer moves work: its merged query intervals per
document, its load, the KV it reads and was given, and the bytes it received (pure Python)."""

from __future__ import annotations

import bisect

from hf_distca.planning.window import Ranges, kv_ranges, kv_start, ranges_union

__all__ = ["ServerState"]


class ServerState:
    """Mutable planning state of one server (the balancer copies it on write, :meth:`clone`)."""

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

    def clone(self) -> ServerState:
        other = ServerState(self.rank)
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
