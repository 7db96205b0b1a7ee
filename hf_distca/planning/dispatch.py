"""build_dispatch_index: turn a plan into one rank's index arrays for dispatch, kernel and return.

Conventions (all ranks derive the same orders from the plan, so no index is ever exchanged):
- the Q stream from holder h to server s: the rows of s's tasks held by h, in s's task order;
- the KV stream from h to s: for each document s needs (ascending id), the rows of its key ranges
  (``CorePlan.kv_ranges``: the KV prefix without a sliding window) held by h, in position order;
- outputs come back from s to h in exactly the order h sent the queries.
A server's pools are ``cat([local rows, rows received from rank 0, from rank 1, ...])``.

With a KV relay (:func:`hf_distca.planning.relay.with_relay`) the KV streams above are those of the first
stage and the KV pool ends with the rows the relays forwarded (``DispatchIndex.relay``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hf_distca.planning.tasks import CorePlan
from hf_distca.planning.window import kv_start


@dataclass(frozen=True)
class RelayIndex:
    """One rank's part in the second stage of a KV relay (:mod:`hf_distca.planning.relay`): KV rows that
    crossed nodes once to this rank go on to the servers of its node that read them."""

    ranks_per_node: int
    send_rows: np.ndarray
    """As a relay: rows of the first stage's KV receive (every source's rows, in rank order) forwarded to
    each server of this node, grouped by server in rank order."""
    send_counts: list[int]
    recv_counts: list[int]
    """As a server: rows each relay of this node forwards here (its sources' rows in rank order)."""


@dataclass
class DispatchIndex:
    """Index arrays of one rank (numpy int64 unless stated)."""

    rank: int
    world_size: int
    num_local: int
    # as a query/KV holder: rows sent to each server (grouped by destination rank, in rank order)
    send_q_rows: np.ndarray
    send_q_counts: list[int]
    send_kv_rows: np.ndarray
    send_kv_counts: list[int]
    # as a server: rows received from each holder
    recv_q_counts: list[int]
    recv_kv_counts: list[int]
    # as a server: the fused kernel call over all its tasks
    kernel_q_index: np.ndarray
    """Into the Q pool, one entry per kernel query row."""
    kernel_kv_index: np.ndarray
    """Into the KV pool, one entry per kernel key row (a prefix shared by two tasks appears twice)."""
    cu_seqlens_q: np.ndarray
    cu_seqlens_k: np.ndarray
    max_seqlen_q: int
    max_seqlen_k: int
    # outputs: kernel rows sent back to each holder, and where every local row's output lies in the
    # output pool cat([kernel output, outputs received from rank 0, from rank 1, ...])
    out_send_index: np.ndarray
    out_send_counts: list[int]
    out_gather: np.ndarray
    """Per computed local row (ascending), where its output lies in the output pool."""
    computed_rows: np.ndarray
    """The local rows whose queries the plan computes, ascending: every local row, except for one part of
    a micro-batch (``build_dispatch_index(..., part=True)``)."""
    relay: RelayIndex | None = None
    """The KV relay's second stage on this rank, or None: KV rows go straight from holder to server."""

    @property
    def out_recv_counts(self) -> list[int]:
        return self.send_q_counts


def _aranges(segments: list[tuple[int, int]]) -> np.ndarray:
    """Concatenate ranges given as (start, length)."""
    if not segments:
        return np.zeros(0, dtype=np.int64)
    starts = np.fromiter((s for s, _ in segments), dtype=np.int64, count=len(segments))
    lens = np.fromiter((n for _, n in segments), dtype=np.int64, count=len(segments))
    total = int(lens.sum())
    # offsets within the output where each segment begins
    seg_begin = np.repeat(np.cumsum(lens) - lens, lens)
    return np.repeat(starts, lens) + (np.arange(total, dtype=np.int64) - seg_begin)


def kv_rows_sent(plan: CorePlan, holder: int, server: int) -> np.ndarray:
    """Local rows of ``holder`` whose keys and values ``server`` reads, in the KV stream's order (documents
    ascending, then their key ranges in order)."""
    ranges = plan.kv_ranges[server]
    return _aranges([
        (start, n)
        for doc in sorted(ranges)
        for lo, hi in ranges[doc]
        for _, start, n in plan.index.segments(doc, lo, hi, holder)
    ])  # fmt: skip


def build_dispatch_index(plan: CorePlan, rank: int, *, part: bool = False) -> DispatchIndex:
    """Index arrays for ``rank`` (cost: its own tasks plus the segments it holds of others' tasks).

    ``part``: the plan's tasks are one part of a micro-batch's (a ping-pong part,
    :func:`hf_distca.planning.ping_pong.part_plans`), so local rows that no task computes are allowed; the
    outputs are then those of the computed rows (``computed_rows``)."""
    index = plan.index
    world = plan.world_size
    num_local = index.tokens_per_rank[rank]

    # --- as a holder: what goes to every other server
    send_q, send_kv, send_q_counts, send_kv_counts = [], [], [], []
    for server in range(world):
        if server == rank:
            send_q_counts.append(0)
            send_kv_counts.append(0)
            continue
        q_segs = [
            (start, n)
            for t in plan.tasks[server]
            for _, start, n in index.segments(t.doc_id, t.q_start, t.q_end, rank)
        ]
        q_rows, kv_rows = _aranges(q_segs), kv_rows_sent(plan, rank, server)
        send_q.append(q_rows)
        send_kv.append(kv_rows)
        send_q_counts.append(len(q_rows))
        send_kv_counts.append(len(kv_rows))

    # --- as a server: what arrives, and the kernel's view of the pools
    recv_q_counts = [0] * world
    recv_kv_counts = [0] * world
    # first pass: count arrivals per holder (needed for pool offsets)
    for t in plan.tasks[rank]:
        for holder, _, n in index.segments(t.doc_id, t.q_start, t.q_end):
            if holder != rank:
                recv_q_counts[holder] += n
    for doc, ranges in plan.kv_ranges[rank].items():
        for lo, hi in ranges:
            for holder, _, n in index.segments(doc, lo, hi):
                if holder != rank:
                    recv_kv_counts[holder] += n
    q_base = num_local + np.concatenate([[0], np.cumsum(recv_q_counts)[:-1]]).astype(np.int64)
    kv_base = num_local + np.concatenate([[0], np.cumsum(recv_kv_counts)[:-1]]).astype(np.int64)

    # KV pool indices of every key range this server needs, per document: (range start, pool indices)
    kv_pos = [0] * world
    doc_kv: dict[int, list[tuple[int, np.ndarray]]] = {}
    for doc in sorted(plan.kv_ranges[rank]):
        doc_kv[doc] = []
        for lo, hi in plan.kv_ranges[rank][doc]:
            segs = []
            for holder, start, n in index.segments(doc, lo, hi):
                if holder == rank:
                    segs.append((start, n))
                else:
                    segs.append((int(kv_base[holder]) + kv_pos[holder], n))
                    kv_pos[holder] += n
            doc_kv[doc].append((lo, _aranges(segs)))

    q_pos = [0] * world
    q_segs, kv_parts, cu_q, cu_k = [], [], [0], [0]
    out_to: list[list[tuple[int, int]]] = [[] for _ in range(world)]  # kernel-row segments per holder
    out_gather = np.full(num_local, -1, dtype=np.int64)
    kernel_row = 0
    for t in plan.tasks[rank]:
        for holder, start, n in index.segments(t.doc_id, t.q_start, t.q_end):
            if holder == rank:
                q_segs.append((start, n))
                out_gather[start : start + n] = np.arange(kernel_row, kernel_row + n)
            else:
                q_segs.append((int(q_base[holder]) + q_pos[holder], n))
                q_pos[holder] += n
                out_to[holder].append((kernel_row, n))
            kernel_row += n
        first = kv_start(t.q_start, plan.window)
        lo, rows = next((lo, rows) for lo, rows in doc_kv[t.doc_id] if lo <= first < lo + len(rows))
        kv_parts.append(rows[first - lo : t.q_end - lo])  # the task's keys [first, q_end)
        cu_q.append(cu_q[-1] + t.q_len)
        cu_k.append(cu_k[-1] + t.q_end - first)
    kernel_q_index = _aranges(q_segs)
    kernel_kv_index = np.concatenate(kv_parts) if kv_parts else np.zeros(0, dtype=np.int64)

    out_send = [_aranges(out_to[h]) for h in range(world)]
    out_send_counts = [len(x) for x in out_send]

    # outputs of rows this rank sent away come back in send order, after the kernel rows
    base = kernel_row
    for server in range(world):
        if server == rank:
            continue
        rows = send_q[server - (server > rank)]
        out_gather[rows] = np.arange(base, base + len(rows))
        base += len(rows)
    computed = np.flatnonzero(out_gather >= 0)
    if not part and len(computed) < num_local:
        missing = int(np.flatnonzero(out_gather < 0)[0])
        raise AssertionError(f"plan bug: local row {missing} of rank {rank} is computed by no server")

    lens_q = np.diff(cu_q)
    lens_k = np.diff(cu_k)
    return DispatchIndex(
        rank=rank,
        world_size=world,
        num_local=num_local,
        send_q_rows=np.concatenate(send_q) if send_q else np.zeros(0, dtype=np.int64),
        send_q_counts=send_q_counts,
        send_kv_rows=np.concatenate(send_kv) if send_kv else np.zeros(0, dtype=np.int64),
        send_kv_counts=send_kv_counts,
        recv_q_counts=recv_q_counts,
        recv_kv_counts=recv_kv_counts,
        kernel_q_index=kernel_q_index,
        kernel_kv_index=kernel_kv_index,
        cu_seqlens_q=np.asarray(cu_q, dtype=np.int64),
        cu_seqlens_k=np.asarray(cu_k, dtype=np.int64),
        max_seqlen_q=int(lens_q.max()) if len(lens_q) else 0,
        max_seqlen_k=int(lens_k.max()) if len(lens_k) else 0,
        out_send_index=np.concatenate(out_send) if out_send else np.zeros(0, dtype=np.int64),
        out_send_counts=out_send_counts,
        out_gather=out_gather[computed],
        computed_rows=computed,
    )
