"""benchmarks/simulate.py (its parts in benchmarks/sim/) and benchmarks/workloads.py: the simulator's parts against closed forms.

Pure Python/NumPy, no processes: the kernel table reproduces its measurements, the link model its
bandwidth points, the traffic matrices the planner's own byte counts, the linear fit its inputs, and
a whole simulation the invariants that hold for any batch (one GPU, no padding: every exact system
equals the ideal; the ideal bounds every exact system; DistCA never balances worse than the layout it starts
from). The workloads replay exactly the documents and batches the recipe trains on.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

import numpy as np
import pytest

from benchmarks import sim, simulate, workloads
from hf_distca.config import DistCAConfig
from hf_distca.data import DistCABatches, layout_pieces
from hf_distca.data.nano import nano_tokens_per_rank, split_documents
from hf_distca.planning import MeasuredCost, plan_core_attention
from hf_distca.planning.cost import causal_pairs
from hf_distca.planning.links import layer_seconds_per_token

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REL = 1e-9  # float64 arithmetic on the same inputs in another order


def setting(world=2, tokens_per_rank=8192, layers=4, **links):
    kernels = sim.KernelTable.from_kernel_rows()
    return sim.Setting(
        world, tokens_per_rank, sim.ModelShape(layers=layers), kernels, sim.Links(**links),
        sim.LinearCost.from_measurements(),
    )  # fmt: skip


def test_kernel_table_reproduces_the_measured_rows():
    table = sim.KernelTable.from_kernel_rows()
    for length, fwd_ms, fwd_bwd_ms in sim.KERNELS_H200:
        fwd, fwd_bwd = table.task_seconds(length, length)
        docs = 65536 // length
        assert docs * fwd * 1e3 == pytest.approx(fwd_ms, rel=REL)
        assert docs * fwd_bwd * 1e3 == pytest.approx(fwd_bwd_ms, rel=REL)
    # a suffix task is priced at the rate of whole documents as long as its query shard
    fwd, _ = table.task_seconds(2048, 8192)
    rate_2k = 32 * causal_pairs(0, 2048) / 3.800e-3
    assert fwd == pytest.approx(causal_pairs(6144, 8192) / rate_2k, rel=REL)


def test_kernel_table_from_a_calibrate_json(tmp_path, monkeypatch):
    path = tmp_path / "table.json"
    lens = [128, 1024]
    seconds = [[1e-5, 2e-4], [None, 4e-4]]
    path.write_text(json.dumps({"format": "hf_distca.cost_table/1", "q_lens": lens, "kv_lens": lens,
                                "seconds": seconds, "measured": {"device": "X", "timed": "forward+backward"}}))  # fmt: skip
    table = sim.KernelTable.from_json(str(path))
    fwd, fwd_bwd = table.task_seconds(1024, 1024)
    assert fwd_bwd == pytest.approx(4e-4, rel=REL) and fwd == pytest.approx(4e-4 / 3.5, rel=REL)
    assert "X" in table.source
    # the DistCA systems plan with the table they are timed with, as cost_table="auto" does on an H200
    s = sim.Setting(2, 1024, sim.ModelShape(layers=2), table, sim.Links(), sim.LinearCost.from_measurements())
    assert sim.planner_config(sim.SYSTEM_SPECS["distca"], s).cost_table == str(path)
    seen = []
    planner = plan_core_attention
    monkeypatch.setattr(
        sim.systems, "plan_core_attention", lambda *a, **k: seen.append(k["cost_model"]) or planner(*a, **k)
    )
    r = sim.simulate(["exact-unbalanced", "distca"], [[[1024, 128, 128]]], s)
    assert r["distca"].step_s >= r["distca"].ideal_step_s > 0
    assert seen and all(isinstance(c, MeasuredCost) and c.timed == "forward+backward" for c in seen)
    path.write_text(json.dumps({"q_lens": lens}))
    with pytest.raises(ValueError, match="not a cost table"):
        sim.KernelTable.from_json(str(path))


def test_links_interpolate_the_measured_points_and_separate_nodes():
    links = sim.Links(gpus_per_node=2, inter_gibps=20.0)
    for size, gibps in sim.NVLINK_ALL_TO_ALL:
        assert links.intra_seconds(np.array([size]))[0] == pytest.approx(size / (gibps * 2**30), rel=REL)
    # between points: log-log interpolation; below the first: the first segment continued; above: flat
    mid = math.sqrt(16 * 256) * 2**20
    assert links.intra_seconds(np.array([mid]))[0] == pytest.approx(
        mid / (math.sqrt(140 * 260) * 2**30), rel=REL
    )
    small = 2**20
    slope = math.log(260 / 140) / math.log(16)
    bw = 140 * (1 / 16) ** slope
    assert links.intra_seconds(np.array([small]))[0] == pytest.approx(small / (bw * 2**30), rel=REL)
    assert links.intra_seconds(np.array([2**32]))[0] == pytest.approx(2**32 / (307 * 2**30), rel=REL)
    host = sim.Links(intra=((1.0, sim.HOST_STAGED_GIBPS),))  # --intra-link host: one flat figure
    assert host.intra_seconds(np.array([2**20, 2**30])) == pytest.approx(
        [2**20 / (22 * 2**30), 1 / 22], rel=REL
    )
    # 4 GPUs on 2 nodes: rank 0 sends 1 GiB to rank 1 (same node) and 2 GiB to rank 2 (other node);
    # both move at once, the slower decides; self-traffic is free
    m = np.zeros((4, 4))
    m[0, 1], m[0, 2], m[3, 3] = 2**30, 2 * 2**30, 5 * 2**30
    assert links.phase_seconds(m) == pytest.approx(max(1 / 307, 2 / 20.0), rel=REL)


def test_traffic_matrices_add_up_to_the_planners_byte_counts():
    lengths = [9000, 3000, 1200, 800, 500, 300, 200]
    pieces = layout_pieces(lengths, world_size=3, tokens_per_rank=5000)
    plan = plan_core_attention(pieces, q_row_bytes=8, kv_row_bytes=4)
    assert plan.moves > 0
    q, kv = sim.traffic(plan, 8, 4)
    # sent: Q out as holder, outputs back as server, KV out as holder
    np.testing.assert_array_equal(q.sum(1) + q.sum(0) + kv.sum(1), plan.bytes_sent)
    np.testing.assert_array_equal(q.sum(0) + q.sum(1) + kv.sum(0), plan.bytes_received)


def test_linear_fit_reproduces_its_measurements():
    kernels = sim.KernelTable.from_kernel_rows()
    linear = sim.LinearCost.from_measurements()
    assert linear.seconds(65536, 8) == pytest.approx(sim.NON_ATTENTION_8_LAYERS, rel=REL)
    for length, seconds in sim.STRAGGLER_4_LAYERS.items():
        fwd, fwd_bwd = kernels.task_seconds(length, length)
        predicted = linear.seconds(65536, 4) + 4 * (65536 // length) * (fwd + fwd_bwd)
        assert predicted == pytest.approx(seconds, rel=0.02)  # the four mixes agree within 2%


def test_model_flops_of_llama3_8b_shape():
    model = sim.ModelShape()
    assert model.matmul_params == 32 * (4096 * (2 * 4096 + 2 * 1024) + 3 * 4096 * 14336) + 4096 * 128256
    assert model.model_flops([1000]) == 6 * model.matmul_params * 1000 + 12 * 32 * 128 * 32 * causal_pairs(
        0, 1000
    )
    assert (model.q_row_bytes, model.kv_row_bytes) == (8192, 4096)


def test_layer_seconds_derived_from_weights_match_the_linear_fit():
    """What enable_distca derives for layer-level ping-pong's hiding work (the layer's weights at the
    default layer_tflops) is, for the Llama-3-8B shape on an H200, the non-attention seconds per token per
    layer fitted to the H200 measurements (benchmarks/sim/costs.py), within 1%; the simulator's planner uses
    the derived value."""
    model = sim.ModelShape()
    weights = 4096 * (2 * 4096 + 2 * 1024) + 3 * 4096 * 14336  # q, o; k, v; gate, up, down
    derived = 4 * 2 * weights / (DistCAConfig().layer_tflops * 1e12)  # forward, recompute, 2 x backward
    assert layer_seconds_per_token(model.layer_weights, DistCAConfig().layer_tflops) == pytest.approx(derived)
    assert derived == pytest.approx(sim.LinearCost.from_measurements().per_token_layer, rel=0.01)
    setting = sim.Setting(64, 32768, model, sim.KernelTable.from_kernel_rows(), sim.Links(8, sim.NVLINK_ALL_TO_ALL, 23.3),
                          sim.LinearCost.from_measurements())  # fmt: skip
    config = sim.planner_config(sim.SYSTEM_SPECS["distca-comm-layers"], setting)
    assert config.layer_ping_pong and config.layer_seconds_per_token == pytest.approx(derived)


def test_one_gpu_every_exact_system_is_the_ideal():
    steps = [[[3000, 2000, 1500, 1692]], [[8192]]]  # full micro-batches: no padding
    s = setting(world=1, tokens_per_rank=8192)
    results = sim.simulate(sim.SYSTEMS, steps, s)
    for name in ("exact-unbalanced", "balanced", "distca"):
        r = results[name]
        assert r.exposed_comm_s == 0 and r.imbalance == 1.0
        assert r.step_s == pytest.approx(r.ideal_step_s, rel=REL)
    # padding is work of the system, not of the ideal; DistCA's data path lays a micro-batch out at the
    # fewest tokens per rank that hold it (DistCAConfig.pad_to_budget=False) unless asked to pad
    tight = sim.simulate(["exact-unbalanced"], [[[3000, 2000]]], s)["exact-unbalanced"]
    assert tight.step_s == pytest.approx(tight.ideal_step_s, rel=REL)
    budget = dataclasses.replace(s, pad_to_budget=True)
    padded = sim.simulate(["exact-unbalanced"], [[[3000, 2000]]], budget)["exact-unbalanced"]
    pad = s.linear.seconds(8192 - 5000, 4) + 4 * sim.pricing._task_seconds(s, 8192 - 5000, 8192 - 5000)
    assert padded.step_s == pytest.approx(padded.ideal_step_s + pad, rel=1e-6)
    # tokens/s counts real tokens; MFU = model FLOPs over time x peak
    r = results["distca"]
    assert r.tokens_per_s == pytest.approx((8192 + 8192) / (2 * r.step_s), rel=REL)
    flops = sum(sim.ModelShape(layers=4).model_flops(mb) for step in steps for mb in step)
    assert r.mfu == pytest.approx(flops / (2 * r.step_s * 989e12), rel=REL)


def test_simulated_systems_on_a_skewed_batch():
    # one 12K document and many short ones over 4 ranks of 4096 tokens: the layout leaves the long
    # document's pieces with most of the attention
    steps = [[[12000] + [256] * 16]]
    s = setting(world=4, tokens_per_rank=4096, gpus_per_node=2, inter_gibps=20.0)
    r = sim.simulate(sim.SYSTEMS, steps, s)
    for name in ("exact-unbalanced", "balanced", "distca", "distca-pingpong"):
        assert r[name].step_s >= r[name].ideal_step_s * (1 - REL)
        assert r[name].ideal_step_s == r["exact-unbalanced"].ideal_step_s
    assert r["distca"].imbalance < r["exact-unbalanced"].imbalance
    # the cost-balanced layout cuts the long document over more holders: less exposed all-to-all time
    # than the token-only layout's cut, whose one holder of the head sends its KV to every other piece
    assert 0 < r["distca"].exposed_comm_s < r["exact-unbalanced"].exposed_comm_s
    assert r["distca"].step_s < r["exact-unbalanced"].step_s
    assert r["hf-default"].exposed_comm_s == 0 and r["hf-default"].sent_gib_max == 0
    # hf-default's chunks skip the cross-chunk attention: less work in total than the exact systems
    assert r["hf-default"].busy_mean_s < r["exact-unbalanced"].busy_mean_s
    # ping-pong hides communication under compute: never slower, exposed only beyond the compute
    assert r["distca-pingpong"].step_s <= r["distca"].step_s
    # the serial schedule: every collective exposed; at least the slowest rank's work plus all of them
    mb = sim.simulate_micro_batch(sim.SYSTEM_SPECS["distca"], steps[0][0], s)
    assert r["distca"].step_s == pytest.approx(mb.step_s, rel=REL)
    assert mb.step_s >= (mb.linear.max() + mb.attention.max() + mb.comm) * (1 - REL)
    assert r["distca"].exposed_comm_s == pytest.approx(mb.comm, rel=1e-6)
    # the gap to the ideal in three parts that add up
    for name in ("distca", "distca-pingpong", "distca-layers"):
        assert sum(r[name].left()) == pytest.approx(r[name].step_s - r[name].ideal_step_s, rel=1e-9)
        assert r[name].left()[0] >= -1e-9 and r[name].left()[1] >= -1e-9
    # plain recompute runs the forward again: more attention time and more communication
    full = sim.simulate(["distca"], steps, sim.Setting(**{**s.__dict__, "recompute": "full"}))["distca"]
    assert full.step_s > r["distca"].step_s and full.exposed_comm_s > r["distca"].exposed_comm_s
    share = sim.ideal_gain_share(r)
    base, ideal = r["exact-unbalanced"].step_s, r["distca"].ideal_step_s
    assert share == pytest.approx((base / r["distca"].step_s - 1) / (base / ideal - 1), rel=REL)


def test_workloads_replay_the_recipes_documents_and_batches(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    import finetune_long_docs as recipe

    sample = workloads.long_document_mix(500, seed=3)
    drawn = workloads.draw_lengths(sample, 80, seed=7)
    path = tmp_path / "sample.json"
    path.write_text(json.dumps(sample))
    docs, _ = recipe.documents_from_lengths(
        recipe.parse_args(["--doc-lengths", str(path), "--num-documents", "80", "--seed", "7"])
    )
    assert [len(d["input_ids"]) for d in docs] == drawn
    steps = workloads.global_batches(
        drawn, world_size=2, tokens_per_rank=16384, grad_accum=2, seed=7, steps=2
    )
    batches = DistCABatches([d["input_ids"] for d in docs], rank=0, world_size=2, tokens_per_rank=16384,
                            grad_accum=2, seed=7)  # fmt: skip
    assert any(n > 32768 for n in drawn)  # truncated to the micro-batch budget, as the loader does
    for index, step in enumerate(steps):
        assert step == [[min(drawn[i], 32768) for i in mb] for mb in batches.step(index)]


def test_long_document_mix():
    lengths = np.array(workloads.long_document_mix(20000, seed=0))
    assert lengths.min() >= 128 and lengths.max() <= 131072
    assert not ((lengths > 4096) & (lengths < 16384)).any()
    share = lengths[lengths >= 16384].sum() / lengths.sum()
    assert 0.6 < share < 0.73  # two thirds in expectation
    assert workloads.long_document_mix(50, seed=1) == workloads.long_document_mix(50, seed=1)


def test_main_writes_a_simulated_report_and_plot(tmp_path, capsys):
    sample = tmp_path / "doclens_tiny.json"
    sample.write_text(json.dumps([300, 2000, 5000, 12000, 700]))
    out = tmp_path / "sim.md"
    rows = simulate.main(["--workload", str(sample), "--workload", "long-mix", "--gpus", "2", "16", "--gpus-per-node",
                     "8", "--tokens-per-rank", "16384", "--steps", "1", "--layers", "2", "--inter-node-gibps", "10",
                     "20", "--out", str(out)])  # fmt: skip
    assert [(r.workload, r.world, r.inter_gibps) for r in rows] == [
        ("tiny", 2, None), ("tiny", 16, 10.0), ("tiny", 16, 20.0),
        ("long-mix", 2, None), ("long-mix", 16, 10.0), ("long-mix", 16, 20.0),
    ]  # fmt: skip
    text = out.read_text()
    assert "**These are simulated figures, not measurements.**" in text
    assert "--workload '<data>/doclens_tiny.json'" in text  # the command, without this machine's paths
    assert str(tmp_path) not in text
    assert (
        "benchmarks/results/kernels_h200.md" in text
        and "fitted to the H200 measurements of benchmarks/sim/costs.py" in text
    )
    # per workload: its table, the communication table, the exposure table, the planning table
    assert text.count("| 16 | 10 | distca |") == 8
    assert text.count("| 16 | 10 | distca-comm |") == 8
    assert "## DistCA against the ideal" in text and "Headline system: **distca**" in text
    assert os.path.getsize(tmp_path / "sim.png") > 1000
    assert (
        simulate.portable("/a/b/c.json") == "<data>/c.json"
        and simulate.portable("x=rel/c.json") == "x=rel/c.json"
    )


def test_comm_aware_planner_in_the_simulator(monkeypatch):
    """A 48K-token document and short ones on 8 GPUs, 4 per node, 5 GiB/s between nodes, on the token-only
    layout (the document whole on one rank): the balance-only planner sends the document's KV prefix to
    every other server and is 2x slower than no balancing; the communication-aware planner (the
    simulated links in its config) keeps it in its node and is faster than both."""
    steps = [[[49152] + [512] * 160]]
    s = setting(world=8, tokens_per_rank=16384, gpus_per_node=4, inter_gibps=5.0)
    config = sim.planner_config(sim.SYSTEM_SPECS["distca-comm"], s)
    assert (config.link_gib_per_s, config.ranks_per_node) == (5.0, 4)
    assert config.intra_node_gib_per_s == pytest.approx(260.0, rel=1e-9)  # the 256 MiB point
    assert sim.planner_config(sim.SYSTEM_SPECS["distca"], s).link_gib_per_s is None
    assert config.cost_table is None  # whole-document rows: the planner balances causal pairs
    monkeypatch.setitem(sim.SYSTEM_SPECS, "tokens", sim.System("tokens", "tokens", True, True))
    monkeypatch.setitem(
        sim.SYSTEM_SPECS, "tokens-comm", sim.System("tokens-comm", "tokens", True, True, comm_aware=True)
    )
    r = sim.simulate(["exact-unbalanced", "tokens", "tokens-comm"], steps, s)
    base, balance_only, priced = r["exact-unbalanced"], r["tokens"], r["tokens-comm"]
    assert balance_only.step_s > 2 * base.step_s and balance_only.kv_fanout == 7  # the problem
    assert priced.step_s < base.step_s < balance_only.step_s
    assert priced.kv_fanout <= 3 and priced.sent_gib_max < balance_only.sent_gib_max / 2
    assert priced.inter_node_share < balance_only.inter_node_share
    assert priced.ideal_step_s == base.ideal_step_s


def test_layer_ping_pong_nano_batches_and_schedule():
    """The data path of layer-level ping-pong (hf_distca.data.nano: whole documents in groups of about
    equal cost, each laid out at its own tokens per rank); its schedule hides exchanges the serial one
    exposes; a micro-batch of one document runs whole."""
    steps = [[[12000, 6720, 5000, 4000, 3000] + [256] * 8]]  # 32768 tokens: the whole budget, no padding
    s = setting(world=8, tokens_per_rank=4096, gpus_per_node=4, inter_gibps=40.0)
    r = sim.simulate(["exact-unbalanced", "distca", "distca-comm-layers"], steps, s)
    serial, layers = r["distca"], r["distca-comm-layers"]
    assert layers.ideal_step_s == serial.ideal_step_s
    assert layers.step_s >= layers.ideal_step_s
    assert layers.exposed_comm_s < 0.5 * layers.comm_s  # most of it hidden
    assert serial.exposed_comm_s == pytest.approx(serial.comm_s, rel=1e-6)  # all of it exposed
    lengths = steps[0][0]
    groups = [[lengths[i] for i in g] for g in split_documents(lengths, 2)]
    tokens = nano_tokens_per_rank(groups, s.world)
    spec = sim.SYSTEM_SPECS["distca-comm-layers"]
    plans = [sim.plan_layout(spec, g, s, t)[1] for g, t in zip(groups, tokens, strict=True)]
    assert [p.index.tokens_per_rank for p in plans] == [[t] * s.world for t in tokens]  # each its own
    assert sim.price_plans(plans, s, "layers").step_s == pytest.approx(layers.step_s, rel=REL)  # the same
    alone = sim.simulate(["distca", "distca-layers"], [[[30000]]], s)  # one document: no nano-batches
    assert alone["distca-layers"].step_s == alone["distca"].step_s
    with pytest.raises(ValueError, match="plans for the 'serial' schedule"):
        sim.price_plans(plans, s, "serial")
