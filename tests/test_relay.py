"""The KV relay's index (hf_distca.planning.relay), pure: both stages simulated with numpy on labels.

Every local token is labelled by its global row. Forward: labels travel through the relayed index's first
stage (holders to servers of their node and to relays) and second stage (relays to the servers of their
node); every server's kernel must read exactly the KV labels the direct index gives it. Backward: random
dK values of the kernel rows travel back the reverse way (servers to relays inside the node, summed there,
relays to holders); every holder must get the sums the direct index gives. The bytes each stage moves
are the ledger's (relay_kv_bytes), and KV crosses nodes no more often than without the relay.
"""

from __future__ import annotations

import numpy as np
import pytest
from oracle import Layout, named_layouts

from hf_distca import DistCAConfig, plan_core_attention
from hf_distca.planning import build_dispatch_index, traffic
from hf_distca.planning.ping_pong import part_plans
from hf_distca.planning.relay import check_topology, forwards, relay_kv_bytes, with_relay

Q_ROW, KV_ROW = 64, 48


def _split(rows: np.ndarray, counts: list[int]) -> list[np.ndarray]:
    return np.split(rows, np.cumsum(counts)[:-1])


def _cases():
    for world, per_node in ((4, 2), (8, 2), (8, 4), (6, 3)):
        for layout in named_layouts(world, seed=3):
            yield pytest.param(layout, per_node, id=f"{layout.name}-{world}x{per_node}")


def _plan(layout: Layout, window: int | None = None):
    config = DistCAConfig(shard_tokens=8, tolerance=0.05)
    return plan_core_attention(
        layout.pieces, q_row_bytes=Q_ROW, kv_row_bytes=KV_ROW, options=config.planner_options(), window=window
    )


@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize(("layout", "per_node"), list(_cases()))
def test_relay_moves_the_direct_rows(layout: Layout, per_node: int, window: int | None):
    """The whole plan and each of its ping-pong nano-batches (whose indices cover part of the rows)."""
    plan = _plan(layout, window)
    relayed_any = False
    for part, is_part in [(plan, False), *((p, True) for p in part_plans(plan, 8, "local_first"))]:
        relayed_any |= _check_relay(part, layout, per_node, is_part)
    assert relayed_any == forwards(plan, per_node)


def test_relay_forwards_in_most_cases():
    """The cases above are not vacuous: in most of them the relay forwards rows inside a node."""
    cases = [p.values for p in _cases()]
    forwarding = sum(forwards(_plan(layout), per_node) for layout, per_node in cases)
    assert forwarding >= 0.75 * len(cases), (forwarding, len(cases))


def _check_relay(plan, layout: Layout, per_node: int, part: bool) -> bool:
    """Both stages and the way back, on labels, for one plan; whether the relay forwarded anything."""
    world = layout.world
    direct = [build_dispatch_index(plan, r, part=part) for r in range(world)]
    relayed = [with_relay(plan, ix, per_node) for ix in direct]
    if all(ix.relay is None for ix in relayed):  # nothing to forward: the direct route itself
        assert all(r is d for r, d in zip(relayed, direct, strict=True)) and not forwards(plan, per_node)
        return False
    assert all(ix.relay is not None for ix in relayed), "every rank joins the second stage"
    local = [layout.rows(r) for r in range(world)]
    rng = np.random.default_rng(0)

    # forward: first stage, then the relays forward what each server of their node reads
    sent1 = [_split(local[h][ix.send_kv_rows], ix.send_kv_counts) for h, ix in enumerate(relayed)]
    recv1 = []
    for s, ix in enumerate(relayed):
        assert ix.recv_kv_counts == [len(sent1[h][s]) for h in range(world)]
        recv1.append(np.concatenate([sent1[h][s] for h in range(world)]))
    sent2 = [_split(recv1[r][ix.relay.send_rows], ix.relay.send_counts) for r, ix in enumerate(relayed)]
    moved = np.zeros((2, world, world))
    for r in range(world):
        for s in range(world):
            moved[0, r, s], moved[1, r, s] = len(sent1[r][s]) * KV_ROW, len(sent2[r][s]) * KV_ROW
            if len(sent2[r][s]):
                assert r // per_node == s // per_node and r != s, "the second stage stays inside a node"
    np.testing.assert_array_equal(moved, np.stack(relay_kv_bytes(plan, KV_ROW, per_node)))
    for s in range(world):
        assert relayed[s].relay.recv_counts == [len(sent2[r][s]) for r in range(world)]
        direct_pool = np.concatenate([local[s], *[local[h][x] for h, x in _direct_kv(direct, s)]])
        relayed_pool = np.concatenate([local[s], recv1[s], *[sent2[r][s] for r in range(world)]])
        np.testing.assert_array_equal(
            relayed_pool[relayed[s].kernel_kv_index], direct_pool[direct[s].kernel_kv_index]
        )

    # backward: per global row, the summed dK over every server's kernel rows that read it
    want = np.zeros(layout.total)
    pools = []
    for s in range(world):
        dk_kernel = rng.standard_normal(len(relayed[s].kernel_kv_index))
        pool_rows = relayed[s].num_local + len(recv1[s]) + sum(relayed[s].relay.recv_counts)
        pool = np.zeros(pool_rows)
        np.add.at(pool, relayed[s].kernel_kv_index, dk_kernel)  # as return_grads' index_add
        np.add.at(want, direct_labels(direct, s, local)[direct[s].kernel_kv_index], dk_kernel)
        pools.append(pool)
    first = [relayed[s].num_local for s in range(world)]
    stage_a = [
        _split(pools[s][first[s] + len(recv1[s]) :], relayed[s].relay.recv_counts) for s in range(world)
    ]
    for r, ix in enumerate(relayed):  # the relay sums what the servers of its node send back
        back = np.concatenate([stage_a[s][r] for s in range(world)])
        np.add.at(pools[r], first[r] + ix.relay.send_rows, back)
    stage_b = [
        _split(pools[s][first[s] : first[s] + len(recv1[s])], relayed[s].recv_kv_counts) for s in range(world)
    ]
    got = np.zeros(layout.total)
    for h, ix in enumerate(relayed):
        mine = pools[h][: first[h]].copy()
        np.add.at(mine, ix.send_kv_rows, np.concatenate([stage_b[s][h] for s in range(world)]))
        got[local[h]] = mine
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    return bool(moved[1].any())


def _direct_kv(direct, server: int):
    """(holder, its local rows) of the direct KV stream to ``server``, in rank order."""
    out = []
    for h, ix in enumerate(direct):
        out.append((h, _split(ix.send_kv_rows, ix.send_kv_counts)[server]))
    return out


def direct_labels(direct, server: int, local) -> np.ndarray:
    """The direct KV pool of ``server`` as global row labels."""
    return np.concatenate([local[server], *[local[h][x] for h, x in _direct_kv(direct, server)]])


@pytest.mark.parametrize(("layout", "per_node"), list(_cases()))
def test_relay_crosses_nodes_less(layout: Layout, per_node: int):
    plan = _plan(layout)
    _, kv = traffic.plan_matrices(plan)
    first, second = relay_kv_bytes(plan, KV_ROW, per_node)
    node = np.arange(layout.world) // per_node
    across = node[:, None] != node[None, :]
    assert first[across].sum() <= kv[across].sum()
    assert second[across].sum() == 0


def test_relay_sends_each_row_once_per_node():
    """relay_kv_bytes on a hand case: inside a node KV goes direct; across nodes a
    holder sends each row once per destination node, to the rank with its local index, which forwards
    every other server of its node exactly the rows it reads. A 4000-token document on rank 0 of 2 nodes
    of 2, short ones elsewhere, balanced: ranks 2 and 3 read prefixes of it from rank 0."""
    pieces = [[(0, 0, 4000)], [(1, 0, 500)], [(2, 0, 500)], [(3, 0, 500)]]
    plan = plan_core_attention(pieces, q_row_bytes=1, kv_row_bytes=1)
    _, direct = traffic.plan_matrices(plan)
    first, second = relay_kv_bytes(plan, kv_row_bytes=1, ranks_per_node=2)
    node = np.arange(4) // 2
    same = node[:, None] == node[None, :]
    np.testing.assert_array_equal(first * same, direct * same)  # inside a node: direct
    assert (second * ~same).sum() == 0  # the forwarding stays inside the node
    # rank 0's rows for node 1 cross once, to rank 2 (local index 0): the larger of the two prefixes
    assert direct[0, 2] > 0 and direct[0, 3] > 0
    assert first[0, 2] == max(direct[0, 2], direct[0, 3]) and first[0, 3] == 0
    assert second[2, 3] == direct[0, 3]  # rank 2 forwards rank 3 what it reads, whole
    assert (first * ~same).sum() < (direct * ~same).sum()


def test_relay_needs_whole_nodes():
    with pytest.raises(ValueError, match="multiple of ranks_per_node=4"):
        check_topology(6, 4)
    check_topology(3, 4)  # one node, not full: nothing to relay
    check_topology(8, 4)
