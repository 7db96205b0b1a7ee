"""scripts/first_multi_gpu_run.py (the first multi-GPU run as one command): its runs and their commands on
GPUs and on the CPU, its refusals, and its results file. The whole command takes minutes even in its
smallest CPU form, so it is not run here; every command it would run is parsed by the parser of the
script it starts (the recipe's and the engine check's), so a flag either accepts is one it really takes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

import pytest
from distributed import ROOT

sys.path.insert(0, os.path.join(ROOT, "recipes"))
import finetune_long_docs  # noqa: E402
import gpu_nccl_engine_check  # noqa: E402


def _script():
    spec = importlib.util.spec_from_file_location(
        "first_multi_gpu_run", os.path.join(ROOT, "scripts", "first_multi_gpu_run.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


fmg = _script()


def _plan(argv: list[str], gpus: int) -> dict:
    return {run.name: run for run in fmg.plan_runs(fmg.parse_args(argv), gpus)}


def _parsed(run) -> object:
    """The run's arguments as the script it starts parses them."""
    if fmg.ENGINE_CHECK in run.argv:
        return gpu_nccl_engine_check.parser().parse_args(run.argv[run.argv.index(fmg.ENGINE_CHECK) + 1 :])
    return finetune_long_docs.parse_args(run.argv[run.argv.index(fmg.RECIPE) + 1 :])


SCHEDULES = ("serial", "ping_pong", "layer_ping_pong", "relay")


def test_gpu_runs():
    runs = _plan(["8", "--out", "somewhere"], gpus=8)
    recipes = [f"{p}:{s}" for p in ("ddp", "fsdp2", "zero3") for s in SCHEDULES]
    assert list(runs) == ["engine_check", *recipes, "ddp:ping_pong:debug_detail"]
    assert not any(run.skip for run in runs.values())
    for name, run in runs.items():
        assert run.env["NCCL_NVLS_ENABLE"] == "0" and run.env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1", name
        assert int(run.env["TORCH_FR_BUFFER_SIZE"]) > 0 and run.env["TORCH_FR_DUMP_TEMP_FILE"].startswith(
            run.logs
        )
        assert ("TORCH_DISTRIBUTED_DEBUG" in run.env) == name.endswith("debug_detail"), name
        assert run.env["TORCH_EXTENSIONS_DIR"] == os.path.join(
            os.path.abspath("somewhere"), "torch_extensions"
        )
        args = _parsed(run)
        if name == "engine_check":
            assert (args.backend, args.cpu, args.timeout, args.ranks_per_node) == ("nccl", False, 180, 4)
            continue
        assert (
            run.output_dir == run.logs == os.path.join(os.path.abspath("somewhere"), name.replace(":", "_"))
        )
        config = run.argv[run.argv.index("--config_file") + 1]
        assert (
            os.path.exists(os.path.join(ROOT, config))
            and name.split(":")[0].replace("ddp", "ddp_1node") in config
        )
        assert args.ddp_timeout == 180 and args.gradient_checkpointing and not args.cpu, name
        assert args.max_steps == (1 if name.endswith("debug_detail") else 5), name
        schedule = name.split(":")[1]
        assert args.ping_pong == (schedule in ("ping_pong", "relay")), name
        assert args.layer_ping_pong == (schedule == "layer_ping_pong"), name
        assert (args.kv_relay, args.ranks_per_node) == (
            (True, 4) if schedule == "relay" else (False, None)
        ), name


def test_cpu_runs():
    runs = _plan(["4", "--cpu", "--max-steps", "3", "--group-timeout", "60"], gpus=8)
    assert _plan(["4"], gpus=0).keys() == runs.keys()  # no GPU: the CPU form
    check = _parsed(runs["engine_check"])
    assert (check.backend, check.cpu, check.timeout, check.ranks_per_node) == ("gloo", True, 60, 2)
    for name, run in runs.items():
        if name.startswith("fsdp2"):
            assert "FSDP needs GPUs" in run.skip
            continue
        assert run.skip is None, name
        if name != "engine_check":
            args = _parsed(run)
            assert args.cpu and args.ddp_timeout == 60 and args.max_steps == (1 if "detail" in name else 3)
            assert (args.deepspeed is not None) == name.startswith("zero3"), name
            assert args.deepspeed in (
                None,
                os.path.join(os.path.abspath(fmg.parse_args(["4"]).out), fmg.CPU_ZERO3),
            )
            assert "cpu_2proc" in run.argv[run.argv.index("--config_file") + 1]


def test_cpu_zero3_config(tmp_path):
    """The CPU's ZeRO-3 config: the repository's without its optimizer section."""
    with open(os.path.join(ROOT, "accelerate_configs", "ds_zero3.json")) as f:
        repo = json.load(f)
    with open(fmg.write_cpu_zero3_config(str(tmp_path))) as f:
        written = json.load(f)
    assert "optimizer" in repo and "optimizer" not in written and written["zero_allow_untested_optimizer"]
    assert written["zero_optimization"] == repo["zero_optimization"]


def test_refusals_and_selection(capsys):
    for n in ("2", "3", "5"):
        few = _plan([n, "--cpu"], gpus=0)
        assert all("two nodes of 2 ranks or more" in few[f"{p}:relay"].skip for p in ("ddp", "zero3"))
        assert _parsed(few["engine_check"]).ranks_per_node is None
    assert "needs 2 ranks" in _plan(["1"], gpus=1)["engine_check"].skip
    with pytest.raises(SystemExit, match="2 GPU"):
        _plan(["4"], gpus=2)
    for bad in (["0"], ["two"], ["2", "--max-steps", "0"], ["2", "--group-timeout", "5"]):
        with pytest.raises(SystemExit):
            fmg.parse_args(bad)
    assert list(_plan(["2", "--cpu", "--only", "relay"], gpus=0)) == [
        "ddp:relay",
        "fsdp2:relay",
        "zero3:relay",
    ]
    assert fmg.main(["2", "--cpu", "--dry-run", "--only", "engine"]) == 0
    assert "gpu_nccl_engine_check.py" in capsys.readouterr().out


HANGS = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
open("{pid_file}", "w").write(str(child.pid))
time.sleep(60)
"""


def test_execute_and_results_file(tmp_path):
    """A run that passes, one that fails, one past its timeout, one skipped: their rows, the final loss from
    the recipe's summary.json, and FAIL overall; at the timeout, what the run started in a session of its
    own is killed too."""
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "summary.json").write_text(json.dumps({"final_loss": 2.5}))

    def run(
        name: str, code: str, timeout: float = 60, skip: str | None = None, output_dir: str | None = None
    ):
        argv = [sys.executable, "-c", code]
        return fmg.Run(name, argv, {"X": "1"}, str(tmp_path / name), timeout, skip, output_dir)

    results = [
        fmg.execute(run("ok", "import os; print(os.environ['X'])", output_dir=str(tmp_path / "ok"))),
        fmg.execute(run("fails", "raise SystemExit(3)")),
        fmg.execute(run("hangs", HANGS.format(pid_file=tmp_path / "child.pid"), timeout=10)),
        fmg.execute(run("skipped", "", skip="not here")),
    ]
    assert [r.exit for r in results] == ["0", "3", "timeout (10 s)", "skipped: not here"]
    child = int((tmp_path / "child.pid").read_text())  # started in a session of its own, as a rank is
    with pytest.raises(ProcessLookupError):
        for _ in range(50):  # killed; reaped by init shortly after
            os.kill(child, 0)
            time.sleep(0.1)
    assert results[0].loss == 2.5 and results[1].loss is None and results[2].seconds < 20
    assert (tmp_path / "ok" / "output.log").read_text() == "1\n"
    assert "X=1" in (tmp_path / "ok" / "command.txt").read_text()
    path = tmp_path / "results.md"
    fmg.write_results(str(path), results, {"command": "test"})
    text = path.read_text()
    assert "status: FAIL (2/4 runs passed or skipped)" in text
    assert (
        "| ok | 0 |" in text
        and "| 2.5000 | ok/ |" in text
        and "| skipped | skipped: not here |  |  |  |" in text
    )
