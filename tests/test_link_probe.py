"""The link probe (DistCAConfig(measure_link=True)) on 2 gloo processes: every rank measures the same
figure at the explicit probe point, once per group, and plans with it; the attention stays exact; an
engine call without the probe raises instead of measuring inside the call."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from oracle import assert_close, named_layouts, oracle_with_grads, random_qkv

from hf_distca import DistCAConfig, core_attention, metrics, plan_core_attention
from hf_distca.engine import engine_state, link_probe, prepare, probe
from hf_distca.planning import attention_flops_per_pair

HQ, HKV, D = 4, 2, 8
CONFIG = DistCAConfig(shard_tokens=8, tolerance=0.3, measure_link=True, ranks_per_node=1, backend="reference")


def _worker(rank: int, world: int) -> dict:
    calls = []
    measure = link_probe.measure_link_gib_per_s

    def counted(*args):
        calls.append(args)
        return measure(*args)

    link_probe.measure_link_gib_per_s = counted  # counts the probes of this process (restored below)
    try:
        layout = next(lay for lay in named_layouts(world, seed=11) if lay.name == "giant")
        q_all, k_all, v_all, w_all = random_qkv(layout.total, HQ, HKV, D, torch.float64, seed=3)
        rows = torch.as_tensor(layout.rows(rank))
        q, k, v = (t[rows].clone().requires_grad_(True) for t in (q_all, k_all, v_all))
        engine_state().reset()
        with pytest.raises(RuntimeError, match="link of this process group was not measured"):
            core_attention(q, k, v, layout.pieces[rank], config=CONFIG, all_pieces=layout.pieces)
        assert not calls  # the engine call raised before any collective: nothing measured
        metrics.reset()
        for _ in range(2):  # the explicit probe point, twice: measured once per group
            probe(CONFIG, device=q.device)
        probes = metrics.snapshot()
        out = core_attention(q, k, v, layout.pieces[rank], config=CONFIG, all_pieces=layout.pieces)
        (out * w_all[rows]).sum().backward()
        measured = link_probe.measured_link_gib_per_s(None)
        assert link_probe.measured_link_gib_per_s(dist.group.WORLD) == measured
        # a second layer: no second probe; the same plan
        prepared = prepare(q, k, v, layout.pieces[rank], config=CONFIG, all_pieces=layout.pieces)
        return {
            "gib": measured,
            "probes": len(calls),
            "recorded": (probes.probes, probes.probe_seconds > 0),
            "digest": prepared.plan.digest(),
            "priced": prepared.plan.critical_path_after is not None,
            "out": out.detach(),
            "grads": (q.grad, k.grad, v.grad),
            "peers": link_probe.peers(rank, world, 1),
        }
    finally:
        link_probe.measure_link_gib_per_s = measure


def test_link_probe_on_gloo():
    world = 2
    results = run_distributed(_worker, world, timeout=150)
    layout = next(lay for lay in named_layouts(world, seed=11) if lay.name == "giant")
    gib = results[0]["gib"]
    assert gib is not None and 0 < gib < math.inf
    for rank, res in enumerate(results):
        assert res["gib"] == gib and res["probes"] == 1 and res["priced"], rank  # one agreed figure
        assert res["recorded"] == (1, True), (
            rank
        )  # the round that measured is in the metrics (not the second)
        assert res["digest"] == results[0]["digest"], rank  # one plan
        assert res["peers"] == [r for r in range(world) if r != rank]
    # the plan is the planner's with the measured figure
    plan = plan_core_attention(
        layout.pieces, q_row_bytes=HQ * D * 8, kv_row_bytes=2 * HKV * D * 8,
        options=DistCAConfig(**{**CONFIG.__dict__, "link_gib_per_s": gib}).planner_options(),
        flops_per_pair=attention_flops_per_pair(HQ, D),
    )  # fmt: skip
    assert plan.digest() == results[0]["digest"]
    q_all, k_all, v_all, w_all = random_qkv(layout.total, HQ, HKV, D, torch.float64, seed=3)
    ref = oracle_with_grads(q_all, k_all, v_all, w_all, layout.doc_lens)
    for rank, res in enumerate(results):
        rows = torch.as_tensor(layout.rows(rank))
        for name, got, want in zip(("out", "dq", "dk", "dv"), (res["out"], *res["grads"]), ref, strict=True):
            assert_close(got, want[rows], "fp64", f"probe rank {rank} {name}")


def test_probe_peers():
    assert link_probe.peers(0, 4, None) == [1, 2, 3]
    assert link_probe.peers(1, 4, 2) == [2, 3]  # the other node
    assert link_probe.peers(3, 4, 4) == [0, 1, 2]  # one node: every other rank
    assert DistCAConfig(measure_link=True).link_gib_per_s is None


def test_probe_splits_match_pairwise_with_nodes_of_unequal_size():
    """12 ranks in nodes of 8 and 4: rank 0 spreads its bytes over the 4 ranks of the other node, rank 8
    over 8; each rank expects from every peer what that peer sends it (the replay at 12 ranks in
    tests/test_collective_replay.py checks the same from the recorded calls)."""
    world, per_node = 12, 8
    splits = [link_probe.probe_splits(r, world, per_node) for r in range(world)]
    for a in range(world):
        for b in range(world):
            assert splits[a][0][b] == splits[b][1][a], (a, b)
    assert splits[0][0][8] == link_probe.PROBE_BYTES // 4 and splits[8][0][0] == link_probe.PROBE_BYTES // 8
    assert all(sum(send) == link_probe.PROBE_BYTES for send, _ in splits)


def _probe_worker(rank: int, world: int, per_node: int) -> float:
    return link_probe.measure_link_gib_per_s(None, torch.device("cpu"), per_node)


def test_link_probe_on_gloo_with_nodes_of_unequal_size():
    """3 gloo ranks in nodes of 2 and 1: rank 2 sends to both ranks of the other node, each of those only to
    rank 2; the probe completes (with the send splits taken for the receive splits it failed) and every
    rank gets the same figure (the slowest rank's seconds, the same bytes sent)."""
    results = run_distributed(_probe_worker, 3, 2, timeout=60)
    assert results[0] > 0 and results == [results[0]] * 3
