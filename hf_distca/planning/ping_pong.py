"""The ping-pong split: the parts of a micro-batch's core attention whose exchanges and
kernels interleave. Pure Python/NumPy; the engine's schedule of the parts is :mod:`hf_distca.engine.ping_pong`.

The split is made on the balanced plan, so it changes neither the plan nor the math: a query row's output
depends only on its own KV prefix, so a task [a, b) cut at m into [a, m) (KV prefix [0, m)) and [m, b) (KV
prefix [0, b)) computes every row exactly as before, and a part's tasks read KV rows from any rank,
including rows whose queries belong to another part.

Two ways to split each server's CA-tasks (``DistCAConfig.ping_pong_split``; every rank splits alike):

- ``"local_first"`` (default): the tasks whose query rows and whole KV prefix the server holds itself
  ("local": they need no exchange at all) in two halves of equal work, around the tasks that need rows
  of other ranks ("remote"), themselves in two halves: parts [local head, remote 0, remote 1, local
  tail]. The remote parts' dispatches fly during the local head's kernel (and remote 1's during remote
  0's), their returns during the local tail's (and remote 0's during remote 1's). After balancing most of
  a server's work is usually its own local work, so this can hide both directions entirely; a server
  whose work all needs other ranks' rows (a tail piece of a document held elsewhere) waits for its first
  dispatch, as without ping-pong.
- ``"halves"``: two parts of equal work, each with its own exchanges (the DistCA paper's ping and pong):
  the first part's dispatch and the second part's return are never hidden.

Parts empty on every server are dropped (no part is ever run that nobody needs).

Halving: a server's documents go whole to the lighter half (largest first); a document is cut only when
whole documents leave the halves more than ``BALANCE`` of their work apart: the cut moves the rows
before some m of one document to the lighter half. Query rows, outputs and their gradients are
partitioned between parts, but a server receives a KV row once per part that reads it, so a cut whose
shared prefix [0, m) holds rows of other ranks sends those rows twice. Such cuts are never made for
``local_first`` (local prefixes are the server's own; remote work is halved by whole documents and free
cuts); ``halves`` makes one only when nothing else brings the halves to a third of the server's work
apart (``DUPLICATE_GAP``), e.g. on a server whose work is a tail shard of a document held elsewhere. Of
two halves that both exchange, the one with fewer bytes to receive (the traffic ledger's forward
dispatch) runs first.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from hf_distca.planning.pieces import DocIndex
from hf_distca.planning.tasks import CATask, CorePlan
from hf_distca.planning.traffic import PHASES, forward_bytes, phase_bytes
from hf_distca.planning.window import Ranges, attended_pairs, kv_ranges, kv_start

__all__ = ["BALANCE", "DUPLICATE_GAP", "PING_PONG_SPLITS", "part_plans", "split_server_tasks"]

PING_PONG_SPLITS = ("local_first", "halves")
"""How ping-pong splits a micro-batch's core attention into parts (``DistCAConfig.ping_pong_split``; the
module docstring)."""

BALANCE = 0.05
"""Whole documents are enough when two halves' work differs by at most this share of their work."""
DUPLICATE_GAP = 1 / 3
"""``halves`` only: a cut that sends KV rows twice is made only when whole documents and free cuts leave
the halves more than this share of the server's work apart (one half below a third)."""


def part_plans(plan: CorePlan, shard_tokens: int, split: str = "local_first") -> list[CorePlan]:
    """The ping-pong parts of ``plan`` split the ``split`` way (one of PING_PONG_SPLITS), in the order they
    run: per part, the plan restricted to its tasks (key ranges, loads and traffic of those tasks); parts
    empty on every server are dropped. ``shard_tokens``: the config's, where cuts prefer to fall. Every
    rank derives the same parts from the same plan; nothing is exchanged."""
    if split not in PING_PONG_SPLITS:
        raise ValueError(f"split must be one of {PING_PONG_SPLITS}, got {split!r}")
    per_server = [
        split_server_tasks(
            tasks, server, plan.index, shard_tokens, plan.q_row_bytes, plan.kv_row_bytes, split, plan.window
        )
        for server, tasks in enumerate(plan.tasks)
    ]
    used = [j for j in range(len(per_server[0])) if any(parts[j] for parts in per_server)]
    return [_part_plan(plan, [server_parts[j] for server_parts in per_server]) for j in used]


# ------------------------------------------------------------------------------------------ the split
def split_server_tasks(
    tasks: list[CATask],
    server: int,
    index: DocIndex,
    shard_tokens: int,
    q_row_bytes: int,
    kv_row_bytes: int,
    split: str = "local_first",
    window: int | None = None,
) -> list[list[CATask]]:
    """One server's tasks in parts (see the module docstring): ``local_first``: [local head, remote 0,
    remote 1, local tail]; ``halves``: [first, second]. Each part in canonical order (doc_id, q_start).
    ``window``: the plan's sliding window (which keys a task reads, what its work is). Deterministic:
    every rank gets the same parts."""
    sizes = (shard_tokens, q_row_bytes, kv_row_bytes, window)
    if split == "halves":
        return list(_halves(tasks, server, index, sizes, allow_duplicate=True))

    def is_local(t: CATask) -> bool:
        first = kv_start(t.q_start, window)
        return index.count_held_by(t.doc_id, first, t.q_end, server) == t.q_end - first

    local = [t for t in tasks if is_local(t)]
    remote = [t for t in tasks if not is_local(t)]
    head, tail = _halves(local, server, index, sizes, allow_duplicate=False)
    return [head, *_halves(remote, server, index, sizes, allow_duplicate=False), tail]


def _halves(
    tasks: list[CATask], server: int, index: DocIndex, sizes: tuple, *, allow_duplicate: bool
) -> tuple[list[CATask], list[CATask]]:
    """``tasks`` in two halves of about equal work, the one with fewer bytes to receive first; ``sizes``:
    (shard_tokens, q_row_bytes, kv_row_bytes, window) as :func:`split_server_tasks` got them."""
    shard_tokens, q_row_bytes, kv_row_bytes, window = sizes
    by_doc: dict[int, list[CATask]] = {}
    for t in sorted(tasks):
        if t.q_len > 0:
            by_doc.setdefault(t.doc_id, []).append(t)
    work = {doc: sum(attended_pairs(t.q_start, t.q_end, window) for t in ts) for doc, ts in by_doc.items()}
    total = sum(work.values())
    load = [0, 0]
    docs: tuple[list[int], list[int]] = ([], [])
    for doc in sorted(by_doc, key=lambda d: (-work[d], d)):  # largest first, to the lighter half
        j = 0 if load[0] <= load[1] else 1
        docs[j].append(doc)
        load[j] += work[doc]
    heavy = 0 if load[0] >= load[1] else 1
    gap = load[heavy] - load[1 - heavy]
    cut = _best_cut(
        by_doc, docs[heavy], work, gap, total, server, index, shard_tokens, window, allow_duplicate
    )
    halves: tuple[list[CATask], list[CATask]] = ([], [])
    for j, side in enumerate((heavy, 1 - heavy)):
        for doc in docs[side]:
            for t in by_doc[doc]:
                if cut is None or cut[0] != doc:
                    halves[j].append(t)
                    continue
                head, tail = (t.q_start, min(t.q_end, cut[1])), (max(t.q_start, cut[1]), t.q_end)
                if head[1] > head[0]:
                    halves[1 - j].append(CATask(doc, *head))  # rows before the cut: to the lighter half
                if tail[1] > tail[0]:
                    halves[j].append(CATask(doc, *tail))
    first, second = sorted(halves[0]), sorted(halves[1])
    inbound = [_inbound_bytes(h, server, index, q_row_bytes, kv_row_bytes, window) for h in (first, second)]
    return (first, second) if (inbound[0], 0) <= (inbound[1], 1) else (second, first)


def _best_cut(
    by_doc: dict[int, list[CATask]],
    heavy_docs: list[int],
    work: dict[int, int],
    gap: int,
    total: int,
    server: int,
    index: DocIndex,
    shard_tokens: int,
    window: int | None,
    allow_duplicate: bool,
) -> tuple[int, int] | None:
    """(doc, m): move that document's rows before m from the heavier half to the lighter one; None: keep
    whole documents. Cuts whose shared KV prefix this server holds itself are free; the others send the
    prefix's remote rows twice and are taken (``allow_duplicate`` only) when the halves stay further
    than ``DUPLICATE_GAP`` apart otherwise."""
    if gap <= BALANCE * total:
        return None
    free, duplicating = [], []  # (gap after, rows sent twice, doc, m)
    for doc in heavy_docs:
        m, moved, shared_end = _head_cut(by_doc[doc], gap / 2, shard_tokens, window)
        new_gap = abs(gap - 2 * moved)
        if moved <= 0 or moved >= work[doc] or new_gap >= gap:
            continue
        shared = kv_start(shared_end, window)  # both sides read keys [shared, shared_end)
        remote = shared_end - shared - index.count_held_by(doc, shared, shared_end, server)
        (duplicating if remote else free).append((new_gap, remote, doc, m))
    best = min(free, default=None)
    if not allow_duplicate or not duplicating or (best[0] if best else gap) <= DUPLICATE_GAP * total:
        return None if best is None else (best[2], best[3])
    # within the balance target: the fewest rows sent twice; else the best balance
    within = [c for c in duplicating if c[0] <= BALANCE * total]
    pick = min(within, key=lambda c: (c[1], c[0], c[2])) if within else min(duplicating)
    return pick[2], pick[3]


def _inbound_bytes(
    tasks: list[CATask], server: int, index: DocIndex, q_row_bytes: int, kv_row_bytes: int, window: int | None
) -> int:
    """Bytes ``server`` receives in the forward dispatch of ``tasks`` (the traffic ledger's): query rows
    and key rows held elsewhere."""
    q_rows = sum(t.q_len - index.count_held_by(t.doc_id, t.q_start, t.q_end, server) for t in tasks)
    kv_rows = sum(
        (hi - lo) - index.count_held_by(doc, lo, hi, server)
        for doc, ranges in _kv_ranges(tasks, window).items()
        for lo, hi in ranges
    )
    columns = np.array([0, 0, q_rows * q_row_bytes, kv_rows * kv_row_bytes])  # Q_OUT, KV_OUT, Q_IN, KV_IN
    return int(phase_bytes(columns)[PHASES.index("fwd.dispatch"), 1])


def _head_cut(
    tasks: list[CATask], target: float, shard_tokens: int, window: int | None = None
) -> tuple[int, int, int]:
    """A cut row m in one document's tasks (sorted by q_start) so that the rows before m cost about
    ``target`` pairs; on a multiple of ``shard_tokens`` when one lies inside the task it cuts.
    Returns (m, the rows-before-m's pairs, the end of the keys both sides read)."""
    done = 0
    for t in tasks:
        pairs = attended_pairs(t.q_start, t.q_end, window)
        if done + pairs <= target:
            done += pairs
            continue
        need = target - done
        a = t.q_start
        if window is None:
            # causal pairs (m (m + 1) - a (a + 1)) / 2 = need  ->  m
            m = int(round((-1.0 + math.sqrt(1.0 + 4.0 * (2.0 * need + a * (a + 1)))) / 2.0))
        else:  # the smallest m whose pairs reach need (pairs grow with m)
            lo, hi = a, t.q_end
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (mid + 1, hi) if attended_pairs(a, mid, window) < need else (lo, mid)
            m = lo
        aligned = int(round(m / shard_tokens)) * shard_tokens
        if a < aligned < t.q_end:
            m = aligned
        m = min(max(m, a), t.q_end)
        if m == a:  # the cut falls on the task's start: the earlier tasks move whole
            prev_end = max((u.q_end for u in tasks if u.q_end <= a), default=0)
            return a, done, prev_end
        return m, done + attended_pairs(a, m, window), m
    return tasks[-1].q_end, done, tasks[-1].q_end


def _part_plan(plan: CorePlan, tasks: list[list[CATask]]) -> CorePlan:
    """The micro-batch's plan restricted to one part's tasks (key ranges, loads and traffic of
    those tasks)."""
    kv = [_kv_ranges(ts, plan.window) for ts in tasks]
    pairs = [sum(attended_pairs(t.q_start, t.q_end, plan.window) for t in ts) for ts in tasks]
    part = dataclasses.replace(
        plan, tasks=tasks, kv_ranges=kv, load_after=[float(p) for p in pairs], pairs_after=pairs
    )
    part.bytes_sent, part.bytes_received = forward_bytes(part)
    return part


def _kv_ranges(tasks: list[CATask], window: int | None) -> dict[int, Ranges]:
    """doc -> the key ranges these tasks read (a part may hold cut, touching pieces of one task)."""
    by_doc: dict[int, list[tuple[int, int]]] = {}
    for t in sorted(tasks):
        by_doc.setdefault(t.doc_id, []).append((t.q_start, t.q_end))
    return {doc: kv_ranges(ivs, window) for doc, ivs in by_doc.items()}
