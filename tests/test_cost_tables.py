"""DistCAConfig(cost_table="auto"): the shipped tables (package data), the rule that picks one, plans with
it, and the start-up measurement that every rank agrees on (2 gloo processes)."""

from __future__ import annotations

import argparse
import json
import os
from importlib import resources

import pytest
import torch
from distributed import run_distributed

from hf_distca import DistCAConfig, calibrate, plan_core_attention
from hf_distca.cli import add_config_arguments, config_from_args
from hf_distca.config import cost_model_from_config
from hf_distca.cost_tables import (
    find_shipped_table,
    load_shipped_table,
    shipped_table_data,
    shipped_table_names,
    table_matches,
    timing,
)
from hf_distca.engine import EngineState, cost_probe, engine_state, prepare, probe
from hf_distca.planning import CausalPairsCost, MeasuredCost, attention_flops_per_pair

H200 = dict(device_name="NVIDIA H200", dtype=torch.bfloat16, q_heads=32, kv_heads=8, head_dim=128)
SHIPPED = {"cudnn": "h200_bf16_32x8x128_cudnn.json", "torch_varlen": "h200_bf16_32x8x128_torch_varlen.json"}
ROW_BYTES = dict(q_row_bytes=32 * 128 * 2, kv_row_bytes=2 * 8 * 128 * 2)
FLOPS = attention_flops_per_pair(32, 128)
# one rank holds a 32K document, the other 128 short ones: pairs and measured time disagree
CASE = cost_probe.TableCase(torch.float32, q_heads=2, kv_heads=1, head_dim=8)  # the agreement cases' inputs
PIECES = [[(0, 0, 32768)], [(1 + i, 0, 256) for i in range(128)]]


def test_shipped_tables_are_package_data_with_provenance():
    names = {entry.name for entry in resources.files("hf_distca.cost_tables").iterdir()}
    assert set(SHIPPED.values()) <= names and shipped_table_names() == sorted(SHIPPED.values())
    for backend, name in SHIPPED.items():
        measured = shipped_table_data(name)["measured"]
        assert measured["device"] == "NVIDIA H200" and measured["backend"] == backend
        assert (measured["dtype"], measured["heads"], measured["kv_heads"], measured["head_dim"]) == (
            "bfloat16", 32, 8, 128,
        )  # fmt: skip
        assert measured["timed"] == "forward+backward"
        assert {"torch", "cuda", "cudnn", "python", "command"} <= set(measured)
        with resources.as_file(resources.files("hf_distca.cost_tables") / name) as path:
            assert MeasuredCost.from_json(path).digest() == load_shipped_table(name).digest()
    with open(os.path.join(os.path.dirname(__file__), "..", "setup.cfg")) as f:
        assert "hf_distca.cost_tables = *.json" in f.read()  # pip install carries them


def test_resolution_rule():
    for backend, name in SHIPPED.items():
        assert find_shipped_table(**H200, backend=backend) == name
    assert find_shipped_table(
        **{**H200, "device_name": " nvidia  H200 ", "dtype": "bfloat16"}, backend="cudnn"
    )
    mismatches = {
        "device_name": "NVIDIA H100 80GB HBM3",
        "dtype": torch.float16,
        "q_heads": 64,
        "kv_heads": 4,
        "head_dim": 64,
    }
    for field, value in mismatches.items():
        assert find_shipped_table(**{**H200, field: value}, backend="cudnn") is None, field
    for backend in ("flash_attn", "reference", "auto"):
        assert find_shipped_table(**H200, backend=backend) is None, backend
    measured = dict(shipped_table_data(SHIPPED["cudnn"])["measured"])
    kw = dict(H200, backend="cudnn")
    assert table_matches(measured, **kw)
    assert not table_matches({**measured, "timed": "forward"}, **kw)
    assert not table_matches({k: v for k, v in measured.items() if k != "head_dim"}, **kw)


def test_auto_plans_with_the_shipped_table_and_pairs_without_one():
    """'auto' with the table the rule picks plans exactly as the explicit path; without one, as None."""
    shipped = load_shipped_table(find_shipped_table(**H200, backend="cudnn"))
    auto = DistCAConfig(shard_tokens=128)
    with resources.as_file(resources.files("hf_distca.cost_tables") / SHIPPED["cudnn"]) as path:
        explicit = DistCAConfig(shard_tokens=128, cost_table=str(path))
        by_path = plan_core_attention(PIECES, **ROW_BYTES, options=explicit.planner_options(), flops_per_pair=FLOPS,
                                      cost_model=cost_model_from_config(explicit))  # fmt: skip
    by_auto = plan_core_attention(PIECES, **ROW_BYTES, options=auto.planner_options(), flops_per_pair=FLOPS,
                                  cost_model=cost_model_from_config(auto, auto_table=shipped))  # fmt: skip
    assert by_auto.digest() == by_path.digest() and by_auto.load_after == by_path.load_after
    # the loads are the table's seconds: the measured cost of each server's tasks
    assert max(by_auto.load_before) == pytest.approx(shipped.task_cost(0, 32768))
    pairs = DistCAConfig(shard_tokens=128, cost_table=None)
    by_pairs = plan_core_attention(PIECES, **ROW_BYTES, options=pairs.planner_options(), flops_per_pair=FLOPS)
    assert by_pairs.digest() != by_auto.digest()
    assert isinstance(cost_model_from_config(auto), CausalPairsCost)  # no table resolved: pairs
    no_table = plan_core_attention(PIECES, **ROW_BYTES, options=auto.planner_options(), flops_per_pair=FLOPS,
                                   cost_model=cost_model_from_config(auto))  # fmt: skip
    assert no_table.digest() == by_pairs.digest()


def test_auto_on_cpu_tensors_is_pairs():
    q = torch.zeros(300, 2, 8)
    k = torch.zeros(300, 1, 8)
    assert cost_probe.describe_device(q.device, q.dtype, DistCAConfig()) is None
    assert cost_probe.auto_cost_table(DistCAConfig(), None, q, k) is None
    engine_state().reset()
    plans = [
        prepare(q, k, k, [(0, 0, 300)], config=DistCAConfig(cost_table=table)).plan
        for table in ("auto", None)
    ]
    assert plans[0].digest() == plans[1].digest() and plans[0].load_after == plans[1].load_after


def test_config_values_and_recipe_flag():
    assert DistCAConfig().cost_table == "auto"
    for bad in ("", 3):
        with pytest.raises(ValueError, match="must be a path"):
            DistCAConfig(cost_table=bad)
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    for argv, want in (([], "auto"), (["--cost-table", "none"], None), (["--cost-table", "auto"], "auto")):
        assert config_from_args(parser.parse_args(argv)).cost_table == want, argv


def test_startup_command_on_cpu(tmp_path, capsys, monkeypatch):
    """``--startup`` times the start-up grid (a stand-in timer: the reference kernel at 32K is minutes)."""
    monkeypatch.setattr(timing, "time_task", lambda q_len, kv_len, **_: 1e-6 * (q_len + kv_len))
    table = calibrate.main(["--out", str(tmp_path / "t.json"), "--device", "cpu", "--backend", "reference",
                            "--dtype", "float32", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
                            "--fuse-tokens", "64", "--startup", "--q-lens", "1", "--kv-lens", "1"])  # fmt: skip
    assert list(table.q_lens) == calibrate.STARTUP_LENS  # --startup overrides the grid
    assert "measured in" in capsys.readouterr().out
    measured = json.loads((tmp_path / "t.json").read_text())["measured"]
    assert measured["repeats"] == calibrate.STARTUP_REPEATS and measured["backend"] == "reference"


# ------------------------------------------------------------------------------- 2 gloo processes
def _worker(rank: int, world: int) -> dict:
    out = {}
    # 1. a fake H200 description: every rank finds the shipped cudnn table; prepare plans with it
    cost_probe.describe_device = lambda device, dtype, config: ("NVIDIA H200", "cudnn")
    rows = sum(p[2] for p in PIECES[rank])
    q = torch.zeros(1, 32, 128, dtype=torch.bfloat16).expand(rows, 32, 128)  # prepare reads shapes only
    k = torch.zeros(1, 8, 128, dtype=torch.bfloat16).expand(rows, 8, 128)
    config = DistCAConfig(shard_tokens=128)
    state = EngineState()
    with pytest.raises(RuntimeError, match="no kernel-cost table was resolved"):  # no probe: no collective
        prepare(q, k, k, PIECES[rank], config=config, all_pieces=PIECES, state=state)
    probe(config, device=q.device, dtypes=[q.dtype], q_heads=32, kv_heads=8, head_dim=128,
          state=state)  # fmt: skip
    prepared = prepare(q, k, k, PIECES[rank], config=config, all_pieces=PIECES, state=state)
    out["shipped_plan"] = prepared.plan.digest()

    # 2. no shipped table fits: every rank measures the start-up grid (the reference kernel on a tiny
    # grid here), and all end with the same table
    kw = dict(device_name="cpu-test", measurable=True, lens=[16, 32], fuse_tokens=64, warmup=0, repeats=1)
    measured = cost_probe.agree_on_table(None, torch.device("cpu"), CASE, "reference", **kw)
    out["measured"] = (measured.digest(), measured.seconds.tolist())
    out["seconds"] = engine_state().measurement_seconds

    # 3. the ranks' timings differ and only rank 0 has a shipped table: the mean of the ranks' tables
    real_time_task, real_find = timing.time_task, cost_probe.find_shipped_table
    timing.time_task = lambda q_len, kv_len, **_: (rank + 1) * 1e-6 * (q_len + kv_len)
    cost_probe.find_shipped_table = lambda *a: SHIPPED["cudnn"] if rank == 0 else None
    try:
        mean = cost_probe.agree_on_table(None, torch.device("cpu"), CASE, "reference", **kw)
    finally:
        timing.time_task, cost_probe.find_shipped_table = real_time_task, real_find
    out["mean"] = (mean.digest(), mean.seconds.tolist())

    # 4. one rank cannot measure: nobody does, every rank plans causal pairs
    kw["measurable"] = rank == 0
    out["pairs"] = cost_probe.agree_on_table(None, torch.device("cpu"), CASE, "reference", **kw)
    return out


def test_auto_tables_agree_on_gloo():
    results = run_distributed(_worker, 2, timeout=240)
    auto = DistCAConfig(shard_tokens=128)
    shipped = load_shipped_table(SHIPPED["cudnn"])
    want = plan_core_attention(PIECES, **ROW_BYTES, options=auto.planner_options(), flops_per_pair=FLOPS,
                               cost_model=cost_model_from_config(auto, auto_table=shipped))  # fmt: skip
    pairs = plan_core_attention(PIECES, **ROW_BYTES, options=DistCAConfig(shard_tokens=128, cost_table=None).planner_options(),
                                flops_per_pair=FLOPS)  # fmt: skip
    assert want.digest() != pairs.digest()  # the ranks planned with the table, not with pairs
    for rank, res in enumerate(results):
        assert res["shipped_plan"] == want.digest(), rank
        assert res["measured"][0] == results[0]["measured"][0], rank  # one table on every rank
        assert res["seconds"] is not None and res["seconds"] > 0
        assert res["pairs"] is None
    seconds = results[0]["measured"][1]
    assert seconds[0][0] > 0 and seconds[1][1] > 0 and seconds[1][0] != seconds[1][0]  # NaN: q 32 > kv 16
    for rank, res in enumerate(results):
        assert res["mean"][0] == results[0]["mean"][0], rank
    mean = results[0]["mean"][1]
    scale = (1 + 2) / 2  # the mean of the ranks' factors 1 and 2
    assert mean[0][1] == pytest.approx(scale * 1e-6 * (16 + 32), rel=1e-12)
    assert mean[1][1] == pytest.approx(scale * 1e-6 * (32 + 32), rel=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_auto_resolves_on_this_gpu():
    """On one GPU: 'auto' picks the shipped table when this GPU, bf16 32/8 x 128 and the kernel match (an
    H200 with cudnn or torch_varlen), else none (one process measures nothing)."""
    q = torch.zeros(128, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.zeros(128, 8, 128, device="cuda", dtype=torch.bfloat16)
    name, backend = cost_probe.describe_device(q.device, q.dtype, DistCAConfig())
    table = cost_probe.auto_cost_table(DistCAConfig(), None, q, k, EngineState())
    shipped = find_shipped_table(name, torch.bfloat16, 32, 8, 128, backend)
    print(f"{name}, backend {backend}: shipped table {shipped}")
    if shipped is None:
        assert table is None
    else:
        assert table.digest() == load_shipped_table(shipped).digest()
