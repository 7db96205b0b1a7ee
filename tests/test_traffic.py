"""The traffic ledger (hf_distca.planning.traffic), pure: every consumer prices bytes through it.

The planner (its plans' byte counts and the link model's critical path), the engine's nano-batch plans
and benchmarks/simulate.py are checked against the ledger's per-phase bytes under the ledger as it is and
under a changed one (a phase carrying one more row kind): they move together. The ledger against the
bytes the engine really sends, phase by phase, is checked on gloo processes in test_engine_distributed.py
(forward and backward), test_ping_pong.py (nano-batches) and test_engine_remat.py (recompute, remat).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks import sim
from hf_distca import DistCAConfig, plan_core_attention
from hf_distca.data import layout_pieces
from hf_distca.engine.ping_pong import ping_pong_parts
from hf_distca.engine.prepare import PreparedAttention
from hf_distca.planning import (
    CausalPairsCost,
    attention_flops_per_pair,
    build_dispatch_index,
    link_model_from_options,
)
from hf_distca.planning import traffic as ledger
from hf_distca.planning.links import plan_critical_path

LENGTHS = [9000, 3000, 1200, 800, 500, 300, 200]
HEADS, KV_HEADS, HEAD_DIM, ELEM = 4, 2, 16, 2


def _changed() -> np.ndarray:
    """The ledger with the backward dispatch sending one more query-sized row and the forward return
    sending KV rows home too."""
    carries = ledger.CARRIES.copy()
    carries[ledger.PHASES.index("bwd.dispatch"), ledger.TO_SERVER, ledger.Q] += 1
    carries[ledger.PHASES.index("fwd.return"), ledger.TO_HOLDER, ledger.KV] += 1
    return carries


def _plan(config: DistCAConfig, q_row: int, kv_row: int):
    pieces = layout_pieces(LENGTHS, world_size=3, tokens_per_rank=5000)
    return plan_core_attention(
        pieces, q_row_bytes=q_row, kv_row_bytes=kv_row, options=config.planner_options(),
        flops_per_pair=attention_flops_per_pair(HEADS, HEAD_DIM),
    )  # fmt: skip


def _observed(config: DistCAConfig, plan=None) -> dict:
    """What each consumer prices for one plan (default: the one planned now), next to the ledger's own
    per-phase bytes."""
    s = sim.Setting(
        3, 5000, sim.ModelShape(layers=2, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM),
        sim.KernelTable.from_kernel_rows(), sim.Links(gpus_per_node=2), sim.LinearCost.from_measurements(),
    )  # fmt: skip
    if plan is None:
        plan = _plan(config, s.model.q_row_bytes, s.model.kv_row_bytes)
    link = link_model_from_options(
        config.planner_options(), CausalPairsCost(), attention_flops_per_pair(HEADS, HEAD_DIM)
    )
    prepared = PreparedAttention(
        plan=plan, index=build_dispatch_index(plan, 0), q_heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        cu_seqlens_q=torch.zeros(1, dtype=torch.int32), cu_seqlens_k=torch.zeros(1, dtype=torch.int32),
        flops_before=[], flops_after=[],
    )  # fmt: skip
    parts = ping_pong_parts(prepared, config.shard_tokens, "halves").parts
    return {
        "plan": plan,
        "ledger": ledger.plan_bytes(plan),
        "critical_path": plan_critical_path(plan, link),
        "link": link,
        "parts": [(p.plan, p.plan.bytes_sent) for p in parts],
        "sim": sim.price_plan(plan, s),
        "layers": s.model.layers,
    }


def _check_consumers(obs: dict, planned: bool = True) -> None:
    """``planned``: the plan was made under the ledger now in force (its own fields then follow it too)."""
    plan, per_phase = obs["plan"], obs["ledger"]  # (phases, ranks, 2)
    forward = ledger.forward_phases()
    # the planner: a plan's bytes are the ledger's forward phases; its critical path the ledger's phases
    # priced at the link's bandwidth (one link class: ranks_per_node None)
    if planned:
        assert plan.bytes_sent == per_phase[forward, :, 0].sum(axis=0).tolist()
        assert plan.bytes_received == per_phase[forward, :, 1].sum(axis=0).tolist()
    link = obs["link"]
    comm = sum(float(per_phase[p].max()) / link.inter_bytes_per_s for p in range(len(ledger.PHASES)))
    want = max(plan.load_after) * link.seconds_per_cost_unit + comm
    assert obs["critical_path"] == pytest.approx(want, rel=1e-12)
    if planned:  # the greedy's own bookkeeping
        assert plan.critical_path_after == pytest.approx(want, rel=1e-12)
    # the engine's nano-batch plans: their bytes are the ledger's too
    for part_plan, sent in obs["parts"]:
        assert sent == ledger.plan_bytes(part_plan)[forward, :, 0].sum(axis=0).tolist()
    # the simulator: every phase of every layer, as the ledger says
    assert obs["sim"].bytes_sent.tolist() == (obs["layers"] * per_phase[:, :, 0].sum(axis=0)).tolist()


def test_consumers_follow_the_ledger(monkeypatch):
    config = DistCAConfig(shard_tokens=64, link_gib_per_s=20.0)
    before = _observed(config)
    _check_consumers(before)
    assert before["plan"].moves > 0 and any(before["plan"].bytes_sent)
    monkeypatch.setattr(ledger, "CARRIES", _changed())
    replanned = _observed(config)
    _check_consumers(replanned)
    assert replanned["plan"].digest() != before["plan"].digest()  # dearer transfers: the greedy moves less
    # the same plan, priced higher by every consumer
    after = _observed(config, before["plan"])
    _check_consumers(after, planned=False)
    columns = ledger.plan_traffic(before["plan"]).sum(axis=1)  # (ranks, 4)
    bwd, ret = ledger.PHASES.index("bwd.dispatch"), ledger.PHASES.index("fwd.return")
    np.testing.assert_array_equal(
        after["ledger"][bwd, :, 0] - before["ledger"][bwd, :, 0], columns[:, ledger.Q_OUT]
    )
    np.testing.assert_array_equal(
        after["ledger"][ret, :, 0] - before["ledger"][ret, :, 0], columns[:, ledger.KV_IN]
    )
    # a plan's forward bytes (what planner and nano-batches store as bytes_sent) gain the KV sent home
    want = [int(x + k) for x, k in zip(before["plan"].bytes_sent, columns[:, ledger.KV_IN], strict=True)]
    assert ledger.forward_bytes(before["plan"])[0] == want != before["plan"].bytes_sent
    assert after["critical_path"] > before["critical_path"]
    assert after["sim"].comm > before["sim"].comm
    assert (after["sim"].bytes_sent > before["sim"].bytes_sent).any()
    assert [s for _, s in after["parts"]] != [s for _, s in before["parts"]]


def test_phase_names_are_the_engine_stages():
    """The ledger's phases are the engine's exchanges, in the order a layer runs them (the stages count
    their bytes under these names, and the profiler ranges carry them)."""
    from hf_distca.engine import stages

    assert ledger.PHASES == (stages.FWD_DISPATCH, stages.FWD_RETURN, stages.BWD_DISPATCH, stages.BWD_RETURN)
    assert ledger.forward_phases().tolist() == [True, True, False, False]


def test_link_classes():
    assert ledger.link_classes(3, 5, None) == ledger.INTER
    assert (ledger.link_classes(1, 2, 2), ledger.link_classes(2, 3, 2)) == (ledger.INTER, ledger.INTRA)
    a, b = np.array([0, 1, 2, 3]), np.array([1, 2, 3, 3])
    assert ledger.link_classes(a, b, 2).tolist() == [ledger.INTRA, ledger.INTER, ledger.INTRA, ledger.INTRA]
    assert ledger.link_classes(a, b, None).tolist() == [ledger.INTER] * 4


def test_distinct_phases_of_the_ledger():
    """Forward dispatch and backward return move the same bytes in opposite directions: one phase twice."""
    send, recv, counts = ledger.distinct_phases()
    assert counts.tolist() == [2, 1, 1]
    assert send.tolist() == [[1, 1, 0, 0], [0, 0, 1, 0], [3, 1, 0, 0]]
    assert recv.tolist() == [[0, 0, 1, 1], [1, 0, 0, 0], [0, 0, 3, 1]]
