"""benchmarks/suite.py without a GPU: arguments, the recipe command of every system, run bookkeeping,
and the report written from per-run metrics files (fake figures, checked against their closed forms)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "recipes"))
import finetune_long_docs as recipe  # noqa: E402
import sequence_parallel_long_docs as sp_recipe  # noqa: E402
import sft_trl  # noqa: E402

from benchmarks import suite, suite_report, suite_runs  # noqa: E402
from hf_distca.config import DistCAConfig  # noqa: E402

REL = 1e-9


def base_argv(tmp_path, *extra):
    lengths = tmp_path / "doclens_tiny.json"
    if not lengths.exists():
        lengths.write_text(json.dumps([300, 700, 1500, 2600, 5000, 120]))
    return ["--name", "t", "--gpus", "2", "--workload", f"tiny={lengths}", "--tokens-per-rank", "4096",
            "--layers", "2", "--steps", "3", "--skip", "1", "--runs-dir", str(tmp_path / "runs"),
            "--results-dir", str(tmp_path / "results"), *extra]  # fmt: skip


def test_arguments_are_checked(tmp_path, capsys):
    for extra, message in (
        (["--skip", "3"], "--skip"),
        (["--gpus", "0"], "--gpus must be >= 1"),
        (["--tokens-per-rank", "64"], "--tokens-per-rank must be >= 128"),
        (["--dry-run", "--report-only"], "exclude each other"),
        (["--systems", "megatron-cp"], "invalid choice"),
        (["--calibrate", "--kernel-table", "t.json"], "leave out --kernel-table"),
    ):
        with pytest.raises(SystemExit):
            suite.parse_args(base_argv(tmp_path, *extra))
        assert message in capsys.readouterr().err
    assert suite.parse_args(["--name", "x", "--gpus", "8", "--workload", "long-mix"]).runs_dir.endswith(
        os.path.join("outputs", "suite", "x")
    )


def test_every_system_is_a_recipe_command_on_the_same_data(tmp_path):
    argv = base_argv(tmp_path, "--systems", *suite_runs.SYSTEM_RUNS, "--workload", "long-mix")
    args = suite.parse_args(argv)
    runs = suite_runs.plan_runs(args, suite_runs.workload_files(args))
    assert [(r.workload, r.system) for r in runs] == [
        (w, s) for w in ("tiny", "long-mix") for s in suite_runs.SYSTEM_RUNS
    ]
    assert os.path.exists(tmp_path / "runs" / "long-mix.json")  # the generated sample the recipe reads
    moves = DistCAConfig().max_planner_moves
    expect = {  # system -> (attn, layout, planner moves, liger) the recipe sees
        "hf-default": ("local", "hf-default", moves, True),
        "exact-unbalanced": ("distca", "tokens", 0, True),
        "balanced": ("distca", "balanced", 0, True),
        "distca": ("distca", "distca", moves, True),
        "distca-sft": ("distca", "distca", moves, False),
        "ulysses": ("distca", "distca", moves, True),
        "torch-cp": ("sdpa", "distca", moves, True),
    }
    parsers = {"sft_trl.py": sft_trl.build_parser().parse_args, "finetune_long_docs.py": recipe.parse_args,
               "sequence_parallel_long_docs.py": sp_recipe.parse_args}  # fmt: skip
    for run in runs:
        launcher, rest = run.command[:6], run.command[6:]
        assert launcher[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        parsed = parsers[os.path.basename(rest[0])](rest[1:])  # the recipe's own checks pass
        assert (parsed.attn, parsed.layout, parsed.max_planner_moves, parsed.liger) == expect[run.system]
        if run.system in ("ulysses", "torch-cp"):
            assert parsed.parallelism == run.system
        assert parsed.tolerance == DistCAConfig().tolerance
        assert (parsed.model, parsed.num_layers, parsed.tokens_per_rank, parsed.bf16) == (
            "llama3-8b-shaped",
            2,
            4096,
            True,
        )
        assert parsed.gradient_checkpointing and parsed.max_steps == 3 and parsed.output_dir == run.out_dir
        assert run.env == {}
    for workload in ("tiny", "long-mix"):  # the same documents for every system of a workload
        data = {
            tuple(r.command[r.command.index("--doc-lengths") :][:6]) for r in runs if r.workload == workload
        }
        assert len(data) == 1
    host = suite_runs.plan_runs(suite.parse_args(base_argv(tmp_path, "--link", "host", "--no-liger",
                                                      "--accelerate-config", "c.yaml")),
                           suite_runs.workload_files(args))  # fmt: skip
    assert all(r.env == {"NCCL_P2P_DISABLE": "1"} and r.out_dir.endswith("-p2p-off") for r in host)
    assert all("--liger" not in r.command and r.command[:4] == ["accelerate", "launch", "--config_file", "c.yaml"]
               for r in host)  # fmt: skip
    own = suite_runs.plan_runs(suite.parse_args(base_argv(tmp_path, "--accelerate-config", "c.yaml", "--systems",
                                                     "ulysses", "torch-cp")), suite_runs.workload_files(args))  # fmt: skip
    assert all(r.command[1:4] == ["-m", "torch.distributed.run", "--standalone"] for r in own)


def test_dry_run_prints_commands_and_runs_nothing(tmp_path, capsys):
    assert suite.main(base_argv(tmp_path, "--dry-run", "--workload", "long-mix", "--calibrate")) is None
    out = capsys.readouterr().out.strip().splitlines()
    table = str(tmp_path / "runs" / "cost_table.json")
    assert out[0].endswith(f"-m hf_distca.calibrate --out {table}")  # measured once, before the runs
    assert len(out) == 9 and all("recipes/finetune_long_docs.py" in line for line in out[1:])
    assert not (tmp_path / "runs").exists() and not (tmp_path / "results").exists()
    with pytest.raises(SystemExit, match="no kernel table"):
        suite.main(base_argv(tmp_path, "--report-only", "--calibrate"))


def test_execute_keeps_finished_runs_and_reports_failures(tmp_path):
    run = suite_runs.Run(
        "w",
        4096,
        "distca",
        str(tmp_path / "r"),
        [sys.executable, "-c", "raise MemoryError('CUDA out of memory')"],
        {},
    )
    status = suite_runs.execute(run, steps=2, timeout=60, log=lambda *a: None)
    assert status.startswith("failed (exit 1)") and "MemoryError: CUDA out of memory" in status
    assert not (tmp_path / "r" / suite_runs.STAMP_FILE).exists()  # a failed run is not stamped
    with open(tmp_path / "r" / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps({"step": i}) + "\n" for i in (1, 2))
    # metrics without the suite's stamp (an older suite's, or a failed run's): run again
    assert suite_runs.stale(run).startswith("no suite_run.json")
    assert suite_runs.execute(run, steps=2, timeout=60, log=lambda *a: None).startswith("failed (exit 1)")
    ok = suite_runs.Run(
        "w", 4096, "distca", str(tmp_path / "ok"), [sys.executable, "-c", "print('trained')"], {"X": "1"}
    )
    assert suite_runs.execute(ok, steps=2, timeout=60, log=lambda *a: None) == "ok"
    assert (tmp_path / "ok" / "run.log").read_text() == "trained\n"
    with open(tmp_path / "ok" / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps({"step": i}) + "\n" for i in (1, 2))
    assert (
        suite_runs.stale(ok) is None and suite_runs.execute(ok, steps=2, timeout=60) == "kept"
    )  # not run again
    # a DistCAConfig default that changed since (what the same command trains changed): run again
    stamp = json.loads((tmp_path / "ok" / suite_runs.STAMP_FILE).read_text())
    stamp["distca_defaults"]["pad_to_budget"] = True
    (tmp_path / "ok" / suite_runs.STAMP_FILE).write_text(json.dumps(stamp))
    assert suite_runs.stale(ok) == "made under other DistCAConfig defaults (pad_to_budget)"
    assert suite_runs.execute(ok, steps=2, timeout=60, log=lambda *a: None) == "ok"
    other = dataclasses.replace(ok, command=[sys.executable, "-c", "print('other')"])
    assert suite_runs.stale(other) == "made by another command"


def fake_run(out_dir, step_times, loss=10.0, bytes_sent=(0, 0), peak=(30.0, 31.5), imbalance=1.1):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "metrics.jsonl"), "w") as f:
        for i, t in enumerate(step_times, 1):
            record = {"step": i, "loss": loss - i * 0.1, "step_time_s": t, "imbalance_after": imbalance}
            if bytes_sent is not None:
                record["bytes_sent"] = list(bytes_sent)
            f.write(json.dumps(record) + "\n")
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump({"peak_memory_gib": list(peak)}, f)


def test_report_from_metrics_files(tmp_path):
    argv = base_argv(
        tmp_path, "--report-only", "--systems", *suite_runs.DEFAULT_SYSTEMS, "ulysses", "torch-cp"
    )
    args = suite.parse_args(argv)
    runs = {r.system: r for r in suite_runs.plan_runs(args, suite_runs.workload_files(args))}
    times = {"hf-default": [9.0, 2.0, 2.2], "exact-unbalanced": [9.0, 3.0, 3.2], "distca": [9.0, 2.5, 2.7],
             "ulysses": [9.0, 2.8, 3.0], "torch-cp": [9.0, 1.0, 1.2]}  # fmt: skip
    sent = {"distca": (2**30, 2**31), "ulysses": (3 * 2**29, 3 * 2**29), "torch-cp": None}
    for system, step_times in times.items():
        fake_run(runs[system].out_dir, step_times, bytes_sent=sent.get(system, (0, 0)))
        suite_runs.write_stamp(runs[system])
    fake_run(runs["balanced"].out_dir, [9.0])  # stopped after its first step
    suite_runs.write_stamp(runs["balanced"])
    path = suite.main(argv)
    with open(path) as f:
        text = f.read()
    assert os.path.basename(path).endswith("-t.md")
    assert "Command: `python -m benchmarks.suite --name t" in text and "<data>/doclens_tiny.json" in text
    assert str(tmp_path) not in text.split("Command:")[1].split("\n")[0]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in text.splitlines() if line.startswith("| ") and "|---" not in line}  # fmt: skip
    # the replayed batches of the run: real tokens and model FLOPs per measured step
    steps, predicted, model = suite_report.predict(
        args, json.loads((tmp_path / "doclens_tiny.json").read_text()), 4096, list(times)
    )
    assert set(predicted) == {"hf-default", "exact-unbalanced", "distca"}
    tokens = [sum(sum(mb) for mb in step) for step in steps[1:]]
    flops = [model.model_flops([n for mb in step for n in mb]) for step in steps[1:]]
    for system, step_times in times.items():
        cells = rows[system]
        assert cells[0] == "kept"
        assert float(cells[1]) == pytest.approx(statistics.median(step_times[1:]), abs=5e-4)
        assert float(cells[2].replace(",", "")) == pytest.approx(sum(tokens) / sum(step_times[1:]), abs=0.5)
        mfu = sum(flops) / (sum(step_times[1:]) * 2 * 989e12)
        assert cells[3] == f"{mfu:.1%}"
        assert cells[4] == "31.5" and cells[5] == "9.90000"
        if system in ("ulysses", "torch-cp"):  # the simulator does not model them
            assert cells[8:12] == ["-", "-", "-", "-"]
            continue
        assert float(cells[8]) == pytest.approx(predicted[system].step_s, abs=5e-3)
        assert cells[9] == f"{predicted[system].step_s / statistics.median(step_times[1:]) - 1:+.0%}"
    assert rows["distca"][7] == "2.00"  # GiB sent by the busiest rank
    assert rows["ulysses"][7] == "1.50" and rows["torch-cp"][7] == "-"  # torch-cp counts no bytes
    assert rows["distca"][-1] == f"{3.1 / 2.6:.2f}x" and rows["exact-unbalanced"][-1] == "1.00x"
    assert rows["balanced"][0] == "stopped early: 1 step(s) recorded, none after the 1 warm-up steps"
    assert "distca: `recipes/finetune_long_docs.py`" in text
    ideal = predicted["exact-unbalanced"].step_s / predicted["exact-unbalanced"].ideal_step_s
    line = next(line for line in text.splitlines() if line.startswith("DistCA against the ideal"))
    assert f"{3.1 / 2.6:.2f}x over exact-unbalanced, ideal {ideal:.2f}x" in line
    assert "fastest exact system measured: distca" in line  # not torch-cp (faster, not exact)
    if ideal >= 1.02:
        assert f"{(3.1 / 2.6 - 1) / (ideal - 1):.0%}" in line
    png = re.search(r"!\[.*\]\((.*\.png)\)", text).group(1)
    assert os.path.getsize(os.path.join(os.path.dirname(path), png)) > 1000
    # a run made under other DistCAConfig defaults is left out of the report, with the reason
    stamp_path = os.path.join(runs["distca"].out_dir, suite_runs.STAMP_FILE)
    with open(stamp_path) as f:
        stamp = json.load(f)
    stamp["distca_defaults"]["pad_to_budget"] = True
    with open(stamp_path, "w") as f:
        json.dump(stamp, f)
    with open(suite.main(argv)) as f:
        rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
                for line in f.read().splitlines() if line.startswith("| ") and "|---" not in line}  # fmt: skip
    assert rows["distca"][0] == "left out: made under other DistCAConfig defaults (pad_to_budget)"
    assert rows["distca"][1] == "" and rows["exact-unbalanced"][0] == "kept"  # no step time measured
