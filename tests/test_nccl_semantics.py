"""NCCL's semantics on one GPU (issue 31, outcome 1): every schedule, with rematerialization-aware
checkpointing, forward and backward, equals the one-process oracle when the engine's all-to-all behaves as
NCCL's (tests/nccl_semantics.py: output poisoned at issue, send buffer read late on a private stream,
completion late at ``wait()``, only the current stream ordered, buffers held until ``wait()``, random
delays and allocation churn); with one wait removed (the exchange orders a stream nobody reads on) it does
not. 2 and 4 gloo processes share GPU 0. CUDA only; on an H200:

    python -m pytest -x --timeout 300 tests/test_nccl_semantics.py

The CPU-side pieces (poison values, split sizes, installing and restoring the replacement) run everywhere.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from nccl_semantics import (
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
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@cuda
def test_one_wait_removed_is_caught():
    """The negative control: with Exchange.wait ordering a stream nobody uses, the received rows are read
    before they land (poison or stale rows): the step no longer equals the oracle. (Schedules whose
    exchanges are asynchronous: serial's blocking exchanges complete inside the collective call.)"""
    names = ["ping_pong:local_first", "layer_ping_pong"]
    results = run_distributed(schedule_case, 2, names, True, 0, timeout=280)
    failures = _check(results, names)
    assert {f.split(": ")[0] for f in failures} >= {f"rank {r} {n}" for r in range(2) for n in names}, (
        failures
    )
