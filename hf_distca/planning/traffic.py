"""The traffic ledger: what each of the engine's all-to-all phases carries, and the bytes of a plan.

The engine (:mod:`hf_distca.engine.stages`) runs four all-to-all-v phases per layer of a training step.
Two kinds of rows travel: query-sized rows (``q_row_bytes``: q, the output, its gradient, dq) and KV rows
(``kv_row_bytes``: one token's k and v, or dk and dv). With a plan, a *holder* (a rank that holds a
task's tokens) sends rows to the task's *server* or gets rows back from it; :data:`CARRIES` counts, per
phase and direction, how many rows of each kind go for each row of that kind the forward dispatch moves:

    phase          to the server        to the holder
    fwd.dispatch   q | k, v             -
    fwd.return     -                    out
    bwd.dispatch   q, out, dout | k, v  -
    bwd.return     -                    dq | dk, dv

Everything that prices bytes reads this one table: the planner (its bookkeeping of each rank's bytes
and the link model's phases, :mod:`hf_distca.planning.links`), the nano-batch split, the engine's byte
counters (per phase, named as here) and ``benchmarks/simulate.py``. A test ties it to the bytes the
engine actually sends. Pure NumPy.

A rank's bytes of one forward dispatch, per link class, are the four columns ``Q_OUT, KV_OUT`` (rows it
holds for other servers) and ``Q_IN, KV_IN`` (rows it receives as a server): a ``(ranks, 2, 4)`` table
(:func:`plan_traffic`); every phase's bytes are weighted sums of these columns (:func:`send_weights`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hf_distca.planning.relay import check_topology, relay_kv_matrices
from hf_distca.planning.tasks import key_range_requests

PHASES = ("fwd.dispatch", "fwd.return", "bwd.dispatch", "bwd.return")
"""The engine's all-to-all phases of one layer, in the order they run (the names of its stages)."""

TO_SERVER, TO_HOLDER = 0, 1
"""Directions: holder -> server, server -> holder."""
Q, KV = 0, 1
"""Row kinds: a query-sized row (``q_row_bytes``), a KV row (``kv_row_bytes``, k and v together)."""

CARRIES = np.array(
    [
        [[1, 1], [0, 0]],  # fwd.dispatch: q | k, v
        [[0, 0], [1, 0]],  # fwd.return: out
        [[3, 1], [0, 0]],  # bwd.dispatch: q, out, dout | k, v
        [[0, 0], [1, 1]],  # bwd.return: dq | dk, dv
    ],
    dtype=np.int64,
)
"""(phases, directions, row kinds): rows sent per row of that kind the forward dispatch moves."""

Q_OUT, KV_OUT, Q_IN, KV_IN = range(4)
"""Columns of a rank's bytes of one forward dispatch."""
INTRA, INTER = 0, 1
"""Link classes: inside a node, between nodes (or between any two ranks without a topology)."""


def forward_phases() -> np.ndarray:
    """(phases,) bool: the phases of a forward call (a plain recompute runs them again)."""
    return np.array([p.startswith("fwd.") for p in PHASES])


def send_weights() -> np.ndarray:
    """(phases, 4): bytes a rank sends in each phase per byte of each column Q_OUT, KV_OUT, Q_IN, KV_IN
    (as a holder it sends to servers, as a server back to holders)."""
    to_server, to_holder = CARRIES[:, TO_SERVER], CARRIES[:, TO_HOLDER]  # (phases, kinds)
    return np.concatenate([to_server, to_holder], axis=1)


def recv_weights() -> np.ndarray:
    """(phases, 4): bytes a rank receives in each phase per byte of each column."""
    to_server, to_holder = CARRIES[:, TO_SERVER], CARRIES[:, TO_HOLDER]
    return np.concatenate([to_holder, to_server], axis=1)


def distinct_phases() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(send (k, 4), receive (k, 4), count (k,)): the phases with distinct per-rank bytes, in ledger
    order. A rank's time in a phase is the larger of what it sends and receives, so a phase that sends
    what another one receives (and receives what it sends) lasts as long: it counts as that one again."""
    send, recv = send_weights(), recv_weights()
    keys: list[tuple] = []
    counts: list[int] = []
    first: list[int] = []
    for p in range(len(PHASES)):
        key = tuple(sorted((tuple(send[p]), tuple(recv[p]))))
        if key in keys:
            counts[keys.index(key)] += 1
        else:
            keys.append(key)
            counts.append(1)
            first.append(p)
    return send[first], recv[first], np.array(counts, dtype=np.int64)


def phase_bytes(columns: np.ndarray) -> np.ndarray:
    """Bytes each rank sends and receives in every phase: ``columns`` (..., 4) of forward-dispatch bytes
    (Q_OUT, KV_OUT, Q_IN, KV_IN) -> (..., phases, 2) [sent, received]."""
    columns = np.asarray(columns)
    sent = columns @ send_weights().T  # (..., phases)
    received = columns @ recv_weights().T
    return np.stack([sent, received], axis=-1)


def link_classes(a: Any, b: Any, ranks_per_node: int | None) -> Any:
    """INTRA where ranks ``a`` and ``b`` share a node (ranks [k n, (k + 1) n) share node k, n =
    ``ranks_per_node``), else INTER; INTER for every pair without a topology. Ints or arrays."""
    if ranks_per_node is None:
        return np.full(np.shape(a), INTER) if isinstance(a, np.ndarray) else INTER
    return (a // ranks_per_node != b // ranks_per_node) * 1  # INTRA is 0, INTER 1


def add_bytes(
    table: np.ndarray, ranks: np.ndarray, link_class: np.ndarray, column: int, nbytes: np.ndarray
) -> None:
    """``table[rank, link class, column] += bytes`` for every entry (repeats add up): a (ranks, 2, 4) table."""
    flat = (ranks * 2 + link_class) * 4 + column
    table += np.bincount(flat, weights=nbytes, minlength=table.size).reshape(table.shape)


def rows_traffic(
    world: int,
    q_rows: tuple[np.ndarray, np.ndarray, np.ndarray],
    kv_rows: tuple[np.ndarray, np.ndarray, np.ndarray],
    q_row_bytes: int,
    kv_row_bytes: int,
    ranks_per_node: int | None = None,
) -> np.ndarray:
    """The (world, 2, 4) forward-dispatch table of moved rows: ``q_rows`` / ``kv_rows`` are (holder,
    server, rows) arrays of query / KV rows, holder != server."""
    traffic = np.zeros((world, 2, 4))
    for (holder, server, n), row_bytes, out_col, in_col in (
        (q_rows, q_row_bytes, Q_OUT, Q_IN),
        (kv_rows, kv_row_bytes, KV_OUT, KV_IN),
    ):
        link_class = link_classes(holder, server, ranks_per_node)
        add_bytes(traffic, holder, link_class, out_col, n * row_bytes)
        add_bytes(traffic, server, link_class, in_col, n * row_bytes)
    return traffic


def plan_rows(plan: Any) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """The rows a :class:`~hf_distca.planning.CorePlan` moves in one forward dispatch, as (holder, server,
    rows) arrays with holder != server: query rows of every task, and the key rows of every server's key
    ranges (each once; the KV prefixes without a sliding window)."""
    docs, starts, ends, servers = [], [], [], []
    for server, tasks in enumerate(plan.tasks):
        for t in tasks:
            docs.append(t.doc_id)
            starts.append(t.q_start)
            ends.append(t.q_end)
            servers.append(server)
    kv_docs, kv_starts, kv_ends, kv_servers = key_range_requests(plan.kv_ranges)
    out = []
    for d, a, b, srv in ((docs, starts, ends, servers), (kv_docs, kv_starts, kv_ends, kv_servers)):
        request, holder, rows = plan.index.segment_rows(d, a, b)
        server = np.asarray(srv, dtype=np.int64)[request]
        remote = holder != server
        out.append((holder[remote], server[remote], rows[remote]))
    return out[0], out[1]


def plan_traffic(plan: Any, ranks_per_node: int | None = None, kv_relay: bool = False) -> np.ndarray:
    """Bytes of one forward dispatch per rank and link class, (ranks, 2, 4) with columns Q_OUT, KV_OUT,
    Q_IN, KV_IN, from a :class:`~hf_distca.planning.CorePlan`'s tasks and key ranges; ``kv_relay``: KV
    rows through the relay (:mod:`hf_distca.planning.relay`) where the ranks span nodes, both stages in the
    one table (the relay's own rows as KV_IN of the first stage and KV_OUT of the second)."""
    q_rows, kv_rows = plan_rows(plan)
    if not relays(kv_relay, ranks_per_node, plan.world_size):
        return rows_traffic(
            plan.world_size, q_rows, kv_rows, plan.q_row_bytes, plan.kv_row_bytes, ranks_per_node
        )
    empty = tuple(np.zeros(0, dtype=np.int64) for _ in range(3))
    table = rows_traffic(plan.world_size, q_rows, empty, plan.q_row_bytes, plan.kv_row_bytes, ranks_per_node)
    return table + kv_ranges_relay_traffic(plan.kv_ranges, plan.index, plan.kv_row_bytes, ranks_per_node)


def relays(kv_relay: bool, ranks_per_node: int | None, world: int) -> bool:
    """Whether KV goes through the relay: asked for, with a topology, over more than one node (raises when
    the ranks do not fill whole nodes)."""
    if not kv_relay or ranks_per_node is None:
        return False
    check_topology(world, ranks_per_node)
    return world > ranks_per_node


def matrix_traffic(matrix: np.ndarray, out_col: int, in_col: int, ranks_per_node: int | None) -> np.ndarray:
    """The (world, 2, 4) table of a (world, world) ``[sender, receiver]`` byte matrix: the sender's bytes
    in ``out_col``, the receiver's in ``in_col``, on their pair's link class."""
    table = np.zeros((matrix.shape[0], 2, 4))
    sender, receiver = np.nonzero(matrix)
    link_class = link_classes(sender, receiver, ranks_per_node)
    add_bytes(table, sender, link_class, out_col, matrix[sender, receiver])
    add_bytes(table, receiver, link_class, in_col, matrix[sender, receiver])
    return table


def kv_ranges_relay_traffic(
    kv_ranges: list[dict[int, list[tuple[int, int]]]], index: Any, kv_row_bytes: int, ranks_per_node: int
) -> np.ndarray:
    """The (world, 2, 4) KV columns of servers reading ``kv_ranges`` through the relay (the planner's start)."""
    world = index.world_size
    table = np.zeros((world, 2, 4))
    for matrix in relay_kv_matrices(kv_ranges, index, world, kv_row_bytes, ranks_per_node):
        table += matrix_traffic(matrix, KV_OUT, KV_IN, ranks_per_node)
    return table


def plan_bytes(plan: Any, kv_relay: int | None = None) -> np.ndarray:
    """(phases, ranks, 2) int64: bytes each rank sends and receives in every phase of one layer under a
    :class:`~hf_distca.planning.CorePlan` (what the engine's counters measure, phase by phase);
    ``kv_relay``: ranks per node when KV rows go through the relay (both stages of each phase: a relay
    receives the first stage's rows as KV_IN and sends the second's as KV_OUT)."""
    columns = plan_traffic(plan, kv_relay, kv_relay is not None).sum(axis=1)  # (ranks, 4) over link classes
    per_rank = phase_bytes(columns)  # (ranks, phases, 2)
    return np.moveaxis(per_rank, 1, 0).astype(np.int64)  # (phases, ranks, 2)


def forward_bytes(plan: Any, table: np.ndarray | None = None) -> tuple[list[int], list[int]]:
    """Bytes each rank sends and receives in one forward call under ``plan`` (the forward phases);
    ``table``: the plan's :func:`plan_traffic`, when already computed."""
    columns = (plan_traffic(plan) if table is None else table).sum(axis=1)  # (ranks, 4)
    per_phase = phase_bytes(columns)[:, forward_phases()].sum(axis=1)  # (ranks, 2)
    return [int(x) for x in per_phase[:, 0]], [int(x) for x in per_phase[:, 1]]


def plan_matrices(
    plan: Any, q_row_bytes: int | None = None, kv_row_bytes: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(Q, KV): (world, world) bytes of the query rows / key rows that rank h (row) holds for server s
    (column) in one forward dispatch (row bytes: the plan's unless given)."""
    world = plan.world_size
    q_row = plan.q_row_bytes if q_row_bytes is None else q_row_bytes
    kv_row = plan.kv_row_bytes if kv_row_bytes is None else kv_row_bytes
    out = []
    for (holder, server, rows), row_bytes in zip(plan_rows(plan), (q_row, kv_row), strict=True):
        matrix = np.zeros((world, world))
        np.add.at(matrix, (holder, server), rows * row_bytes)
        out.append(matrix)
    return out[0], out[1]


def phase_matrices(q: np.ndarray, kv: np.ndarray) -> list[np.ndarray]:
    """Per phase, the (world, world) bytes ``[sender, receiver]`` of one layer, from the forward
    dispatch's ``q[holder, server]`` query bytes and ``kv[holder, server]`` KV bytes."""
    out = []
    for carries in CARRIES:
        to_server = carries[TO_SERVER, Q] * q + carries[TO_SERVER, KV] * kv
        to_holder = carries[TO_HOLDER, Q] * q + carries[TO_HOLDER, KV] * kv
        out.append(to_server + to_holder.T)
    return out
