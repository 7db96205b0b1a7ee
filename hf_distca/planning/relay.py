"""The KV relay: a KV row crosses nodes once per destination node, not once per server that reads it.

Without it a holder sends a long document's keys and values to every server that reads them: cut over
hundreds of ranks, the prefix crosses the same inter-node link once per server. With it (nodes of
``n = ranks_per_node`` ranks, rank r in node ``r // n`` at lane ``r % n``):

- first stage: a holder sends KV rows to servers of its own node directly, and to each other node that
  reads any of its rows the union of those rows once, to that node's rank of its own lane (the relay:
  rail-aligned, so the crossing stays on the holder's NIC rail); query rows go direct as before;
- second stage, inside each node: the relay forwards each server of its node the rows it reads (a relay
  that is itself a server reads them where they arrived).

Gradients take the reverse way in backward: servers send the dK/dV of relayed rows to the relay inside
their node, which sums them and sends one row per union row across nodes. Same rows, same sums: the
engine's results equal those without the relay, up to the dK/dV sums: added in another order, and in
half precision rounded once more (the relay's partial sum on its way home).

:func:`with_relay` turns one rank's :class:`~hf_distca.planning.DispatchIndex` into its relayed one;
:func:`relay_kv_bytes` is what the relay moves, for the traffic ledger (:mod:`.traffic`). Pure NumPy.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hf_distca.planning.dispatch import DispatchIndex, RelayIndex
from hf_distca.planning.tasks import CorePlan, key_range_requests
from hf_distca.planning.window import ranges_union


def check_topology(world: int, ranks_per_node: int) -> None:
    """Raise unless ``world`` ranks fill whole nodes of ``ranks_per_node`` (every relay must exist) or one
    node (nothing to relay)."""
    if world > ranks_per_node and world % ranks_per_node:
        raise ValueError(
            f"the KV relay needs whole nodes: {world} ranks are not a multiple of ranks_per_node="
            f"{ranks_per_node}; set DistCAConfig.ranks_per_node to the ranks of one node, or kv_relay=False"
        )


def relay_rank(holder: int, node: int, ranks_per_node: int) -> int:
    """The rank of ``node`` that relays ``holder``'s KV rows: the one at the holder's lane."""
    return node * ranks_per_node + holder % ranks_per_node


def forwards(plan: CorePlan, ranks_per_node: int) -> bool:
    """Whether the relay would forward anything: some KV row crosses nodes to a server that is not its
    holder's relay there (else every crossing already goes to its relay, and the relay is the direct
    route). Every rank reads the same plan, so every rank decides alike."""
    n = ranks_per_node
    for server, per_doc in enumerate(plan.kv_ranges):
        for doc, ranges in per_doc.items():
            for lo, hi in ranges:
                for holder, _, _ in plan.index.segments(doc, lo, hi):
                    if holder // n != server // n and relay_rank(holder, server // n, n) != server:
                        return True
    return False


def _reads(plan: CorePlan, servers: range, holders: set[int]) -> dict[int, dict[int, list]]:
    """holder -> server -> the holder's local rows the server reads, in the KV stream's order (as
    :func:`~hf_distca.planning.dispatch.kv_rows_sent`), for every holder of ``holders``: one pass over the
    servers' key ranges."""
    out: dict[int, dict[int, list]] = {h: {s: [] for s in servers} for h in holders}
    for s in servers:
        ranges = plan.kv_ranges[s]
        for doc in sorted(ranges):
            for lo, hi in ranges[doc]:
                for holder, start, rows in plan.index.segments(doc, lo, hi):
                    if holder in out:
                        out[holder][s].append(np.arange(start, start + rows, dtype=np.int64))
    return out


def _split(rows: np.ndarray, counts: list[int]) -> list[np.ndarray]:
    return np.split(rows, np.cumsum(counts)[:-1])


def with_relay(plan: CorePlan, index: DispatchIndex, ranks_per_node: int) -> DispatchIndex:
    """``index`` (of ``plan``, direct KV streams) with its KV streams through the relay: the first stage's
    KV send and receive, the second stage (``relay``), and the kernel's KV rows in the relayed pool
    ``cat([local rows, first stage's KV rows from rank 0, 1, ..., second stage's from rank 0, 1, ...])``.
    ``index`` unchanged when the relay would forward nothing (:func:`forwards`: then it is the direct route)."""
    n, world, me = ranks_per_node, index.world_size, index.rank
    check_topology(world, n)
    if world <= n or not forwards(plan, n):
        return index
    node, lane = me // n, me % n
    node_ranks = range(node * n, (node + 1) * n)
    direct_send = _split(index.send_kv_rows, index.send_kv_counts)  # per server, rank order

    # first stage, as a holder: direct inside the node, one union per other node to its relay
    send1 = []
    for dest in range(world):
        if dest == me or (dest // n != node and dest % n != lane):
            send1.append(np.zeros(0, dtype=np.int64))
        elif dest // n == node:
            send1.append(direct_send[dest])
        else:
            other = range(dest // n * n, dest // n * n + n)
            send1.append(np.unique(np.concatenate([direct_send[s] for s in other])))
    # as a relay: every remote holder of this lane, the rows each server of this node reads from it
    remote = [h for h in range(lane, world, n) if h // n != node]
    reads = {
        h: {s: np.concatenate([np.zeros(0, dtype=np.int64), *rows]) for s, rows in per_server.items()}
        for h, per_server in _reads(plan, node_ranks, set(remote)).items()
    }
    union = {h: np.unique(np.concatenate(list(reads[h].values()))) for h in remote}
    recv1 = [
        len(union[src]) if src in union else (index.recv_kv_counts[src] if src // n == node else 0)
        for src in range(world)
    ]
    off1 = np.concatenate([[0], np.cumsum(recv1)]).astype(np.int64)

    # second stage, as a relay: each server of the node gets its rows, per holder in rank order
    send2 = [
        np.concatenate([off1[h] + np.searchsorted(union[h], reads[h][s]) for h in remote])
        if s // n == node and s != me and remote
        else np.zeros(0, dtype=np.int64)
        for s in range(world)
    ]
    # as a server: each relay of the node forwards the rows of its lane's remote holders, in rank order
    recv2 = [0] * world
    within = np.zeros(world, dtype=np.int64)  # where a remote holder's rows start in its relay's block
    for src in range(world):
        if src // n != node:
            r = relay_rank(src, node, n)
            if r != me:
                within[src] = recv2[r]
                recv2[r] += index.recv_kv_counts[src]
    off2 = int(off1[-1]) + np.concatenate([[0], np.cumsum(recv2)]).astype(np.int64)

    # the kernel's KV rows: direct pool position -> relayed pool position
    moved = []
    for src, count in enumerate(index.recv_kv_counts):
        if not count:
            continue
        if src // n == node:
            moved.append(off1[src] + np.arange(count))
        elif relay_rank(src, node, n) == me:
            moved.append(off1[src] + np.searchsorted(union[src], reads[src][me]))
        else:
            moved.append(off2[relay_rank(src, node, n)] + within[src] + np.arange(count))
    to_relayed = index.num_local + np.concatenate([np.zeros(0, dtype=np.int64), *moved])
    kernel_kv = index.kernel_kv_index.copy()
    received = kernel_kv >= index.num_local
    kernel_kv[received] = to_relayed[kernel_kv[received] - index.num_local]
    return dataclasses.replace(
        index,
        send_kv_rows=np.concatenate(send1),
        send_kv_counts=[len(x) for x in send1],
        recv_kv_counts=recv1,
        kernel_kv_index=kernel_kv,
        relay=RelayIndex(n, np.concatenate(send2), [len(x) for x in send2], recv2),
    )


def relay_kv_bytes(plan: CorePlan, kv_row_bytes: int, ranks_per_node: int) -> tuple[np.ndarray, np.ndarray]:
    """KV bytes of one forward dispatch through the relay, ``(first, second)`` stage, each (world, world)
    ``[sender, receiver]`` (what :func:`with_relay`'s streams carry; query rows are not in them)."""
    return relay_kv_matrices(plan.kv_ranges, plan.index, plan.world_size, kv_row_bytes, ranks_per_node)


def relay_kv_matrices(
    kv_ranges: list[dict[int, list[tuple[int, int]]]],
    index,
    world: int,
    kv_row_bytes: int,
    ranks_per_node: int,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`relay_kv_bytes` of servers reading ``kv_ranges`` (per server, doc -> key ranges) from the
    holders of ``index`` (a :class:`~hf_distca.planning.DocIndex`): the planner's start as well as a plan."""
    n = ranks_per_node
    first = np.zeros((world, world))
    second = np.zeros((world, world))
    docs, starts, ends, servers = key_range_requests(kv_ranges)
    per_node: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (doc, node) -> its servers' key ranges
    for doc, lo, hi, server in zip(docs, starts, ends, servers, strict=True):
        per_node.setdefault((doc, server // n), []).append((lo, hi))
    if not docs:
        return first, second
    # every server's rows: direct inside its node, else forwarded by the relay unless it is the relay
    request, holder, rows = index.segment_rows(docs, starts, ends)
    server = np.asarray(servers, dtype=np.int64)[request]
    relay = server // n * n + holder % n
    inside = (holder // n == server // n) & (holder != server)
    forwarded = (holder // n != server // n) & (relay != server)
    np.add.at(first, (holder[inside], server[inside]), rows[inside] * kv_row_bytes)
    np.add.at(second, (relay[forwarded], server[forwarded]), rows[forwarded] * kv_row_bytes)
    # across nodes: each holder's rows of the union its node's servers read, once, to its relay there
    docs, starts, ends, nodes = [], [], [], []
    for (doc, node), ranges in per_node.items():
        for lo, hi in ranges_union(ranges, []):
            docs.append(doc)
            starts.append(lo)
            ends.append(hi)
            nodes.append(node)
    request, holder, rows = index.segment_rows(docs, starts, ends)
    node = np.asarray(nodes, dtype=np.int64)[request]
    across = holder // n != node
    np.add.at(first, (holder[across], node[across] * n + holder[across] % n), rows[across] * kv_row_bytes)
    return first, second
