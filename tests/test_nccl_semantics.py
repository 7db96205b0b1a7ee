"""NCCL's semantics on one GPU (issue 31, outcome 1): every schedule, with rematerialization-aware
checkpointing, forward and backward, equals the one-process oracle when the engine's all-to-all behaves as
NCCL's (tests/nccl_semantics.py: output poisoned at issue, send buffer read late on a private stream,
completion late at ``wait()``, only the current stream ordered, buffers held until ``wait()``, random
delays and allocation churn); with one wait removed (the exchange orders a stream nobody reads on) it does
not. 2 and 4 gloo processes share GPU 0. CUDA only; on an H200:

    python -m pytest -x --timeout 300 tests/test_nccl_semantics.py

PyTorch's CUDA sanitizer (CSAN) checks one schedule on ranks that turn it on before their first CUDA call
(:func:`test_cuda_sanitizer_finds_no_race_and_the_missing_wait`). ``TORCH_CUDA_SANITIZER=1`` around the whole
file does not work: the forkserver the ranks come from would import torch with it and initialise CUDA
before the fork.

The CPU-side pieces (poison values, split sizes, installing and restoring the replacement) run everywhere.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from distributed import ROOT, run_distributed
from gpu_results import record
from nccl_semantics import (
    SANITIZER_ENV,
    SCHEDULES,
    installed,
    nccl_like_all_to_all_single,
    poison_value,
    schedule_case,
    split_sizes,
)
from nccl_semantics import Semantics as NcclSemantics

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DIRECT = [name for name, fields in SCHEDULES.items() if not fields.get("kv_relay")]
RELAYED = [name for name, fields in SCHEDULES.items() if fields.get("kv_relay")]


def test_poison_and_splits():
    assert math.isnan(poison_value(torch.float32)) and math.isnan(poison_value(torch.bfloat16))
    assert poison_value(torch.uint8) == 255 and poison_value(torch.int64) == 2**63 - 1
    assert split_sizes([3, 0, 2], 5, 3) == [3, 0, 2] and split_sizes(None, 6, 3) == [2, 2, 2]
    with pytest.raises(ValueError, match="equally"):
        split_sizes(None, 7, 3)


def test_installed_replaces_and_restores():
    original = dist.all_to_all_single
    with installed(NcclSemantics()):
        assert dist.all_to_all_single is not original
        with pytest.raises(RuntimeError, match="installed already"), installed(NcclSemantics()):
            pass
    assert dist.all_to_all_single is original
    assert nccl_like_all_to_all_single.__name__ in dir(__import__("nccl_semantics"))


def _check(results: list[dict], names: list[str]) -> list[str]:
    """Every rank's run of every schedule against the oracle: the failures (empty: all equal)."""
    from test_engine_remat import assert_grads_close
    from test_layer_ping_pong import _oracle
    from tolerances import TOL

    oracle = _oracle()
    failures = []
    for rank, runs in enumerate(results):
        for name in names:
            run = runs[name]
            assert run["issued"] == run["waited"] > 0, (rank, name, run["issued"], run["waited"])
            label = f"rank {rank} {name}"
            if not abs(run["loss"] - oracle["loss"]) <= TOL["train_loss"][0] * abs(oracle["loss"]):
                failures.append(f"{label}: loss {run['loss']} vs {oracle['loss']}")
                continue
            try:
                assert_grads_close(run["grads"], oracle["grads"], label)
            except AssertionError as err:
                failures.append(str(err).splitlines()[0])
    return failures


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(
    ("world", "names"), [(2, DIRECT), (4, RELAYED + ["ping_pong:halves"])], ids=["2", "4"]
)
def test_every_schedule_equals_the_oracle_under_nccl_semantics(world, names):
    results = run_distributed(schedule_case, world, names, False, 0, timeout=280)
    failures = _check(results, names)
    record(f"test_nccl_semantics::every_schedule[{world}]", schedules=names, failures=failures)
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@cuda
def test_one_wait_removed_is_caught():
    """The negative control: with Exchange.wait ordering a stream nobody uses, the received rows are read
    before they land (poison or stale rows): the step no longer equals the oracle. (Schedules whose
    exchanges are asynchronous: serial's blocking exchanges complete inside the collective call.)"""
    if SANITIZER_ENV in os.environ:
        pytest.skip("under the CUDA sanitizer the missing wait raises as a race on the ranks")
    names = ["ping_pong:local_first", "layer_ping_pong"]
    results = run_distributed(schedule_case, 2, names, True, 0, timeout=280)
    failures = _check(results, names)
    record("test_nccl_semantics::one_wait_removed", schedules=names, failures=failures)
    assert {f.split(": ")[0] for f in failures} >= {f"rank {r} {n}" for r in range(2) for n in names}, (
        failures
    )


SANITIZED_RUNS = """
import sys
import torch
from distributed import run_distributed
from nccl_semantics import sanitized_schedule_case

names = sys.argv[2].split(",")
runs = {broken: run_distributed(sanitized_schedule_case, 2, names, broken, timeout=120) for broken in (False, True)}
torch.save(runs, sys.argv[1])
"""
"""Run in a fresh interpreter (no CUDA before the ranks' fork): the step as it is, then with one wait removed."""


@pytest.mark.gpu
@cuda
def test_cuda_sanitizer_finds_no_race_and_the_missing_wait(tmp_path):
    """PyTorch's CUDA sanitizer on 2 ranks of one schedule with asynchronous exchanges. It must be on
    before CUDA is used, so a fresh interpreter is started with ``TORCH_CUDA_SANITIZER=1``; its forkserver
    imports torch with it and every rank is forked with the sanitizer's dispatch mode on (each rank reports
    how many kernel launches it checked). The step as it is: no race, and it still equals the oracle. With
    one wait removed: races on every rank (the read of a received buffer on a stream that never waited for
    the copy onto it). The sanitizer checks the recorded order of launches and events, not timing, so both
    outcomes are deterministic."""
    names = ["ping_pong:local_first"]
    out = tmp_path / "runs.pt"
    path = os.pathsep.join(p for p in (os.path.join(ROOT, "tests"), ROOT, os.environ.get("PYTHONPATH")) if p)
    env = {k: v for k, v in os.environ.items() if k != SANITIZER_ENV} | {"PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, "-c", SANITIZED_RUNS, str(out), ",".join(names)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    runs = torch.load(out, weights_only=False)
    clean, broken = runs[False], runs[True]
    record(
        "test_nccl_semantics::sanitizer",
        schedules=names,
        launches=[r["launches"] for r in clean],
        races=[r["races"] for r in clean],
        races_with_one_wait_removed=[r["races"] for r in broken],
    )
    assert all(r["enabled"] and r["launches"] > 0 for r in clean + broken), "the sanitizer was not on"
    assert all(r["races"] == 0 for r in clean), "\n".join(sum((r["first_races"] for r in clean), []))
    failures = _check([r["run"] for r in clean], names)
    assert not failures, "\n".join(failures)
    assert all(r["races"] > 0 for r in broken), [r["races"] for r in broken]
