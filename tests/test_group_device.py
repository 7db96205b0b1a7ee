"""The device a collective runs on, fixed once (issue 31, outcome 4).

``hf_distca.comm.collective_device`` puts an NCCL collective's tensors on the group's bound device
(``init_process_group(device_id=...)``), else on the current CUDA device, and refuses a current device
other than the bound one; gloo groups have no bound device (the fallback path, checked on a real gloo
group). The NCCL branch is checked with the backend and the devices stood in for (no GPU here). The
benchmarks and the NCCL engine check start NCCL bound to LOCAL_RANK's GPU.
"""

from __future__ import annotations

import ast
import pathlib
import types

import pytest
import torch
import torch.distributed as dist

from hf_distca import comm

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def gloo_world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_gloo_has_no_bound_device_and_gathers_on_the_cpu(gloo_world):
    assert comm.bound_device(None) is None and comm.bound_device(gloo_world) is None
    assert comm.collective_device(gloo_world, torch.device("cpu")) == torch.device("cpu")


@pytest.fixture
def nccl(monkeypatch):
    """The NCCL branch without a GPU: the backend says "nccl" and the current CUDA device is ``current[0]``."""
    current = [0]
    monkeypatch.setattr(comm.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    return current


def test_nccl_uses_the_bound_device(nccl):
    group = types.SimpleNamespace(bound_device_id=torch.device("cuda", 3))
    nccl[0] = 3
    assert comm.collective_device(group, torch.device("cpu")) == torch.device("cuda", 3)
    assert comm.collective_device(group, torch.device("cuda", 3)) == torch.device("cuda", 3)


def test_nccl_without_a_bound_device_uses_the_current_one(nccl):
    nccl[0] = 2
    group = types.SimpleNamespace(bound_device_id=None)
    assert comm.collective_device(group, torch.device("cpu")) == torch.device("cuda", 2)
    assert comm.collective_device(types.SimpleNamespace(), torch.device("cpu")) == torch.device("cuda", 2)


def test_nccl_refuses_a_current_device_other_than_the_bound_one(nccl):
    group = types.SimpleNamespace(bound_device_id=torch.device("cuda", 1))
    nccl[0] = 0
    with pytest.raises(
        RuntimeError, match=r"bound to cuda:1 .* current CUDA device is cuda:0.*set_device\(1\)"
    ):
        comm.collective_device(group, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="bound to cuda:1"):
        comm.collective_device(group, torch.device("cuda", 0))


def _nccl_inits(path: pathlib.Path) -> list[ast.Call]:
    """The ``init_process_group`` calls of ``path`` that may start NCCL (a literal "gloo" backend aside)."""
    calls = []
    for node in ast.walk(ast.parse(path.read_text())):
        # torch's (dist.init_process_group), not benchmarks.common's wrapper of it
        call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        if call and node.func.attr == "init_process_group":
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and first.value == "gloo":
                continue
            calls.append(node)
    return calls


def test_every_nccl_start_outside_the_tests_binds_the_device():
    """Scripts that start NCCL themselves (accelerate launch starts it for the recipes, after set_device) go
    through benchmarks.common.init_process_group, which binds LOCAL_RANK's GPU; the NCCL engine check binds its own."""
    paths = [*ROOT.glob("benchmarks/**/*.py"), *ROOT.glob("recipes/*.py"), *ROOT.glob("scripts/*.py")]
    paths.append(ROOT / "tests" / "gpu_nccl_engine_check.py")
    direct = []
    for path in paths:
        for call in _nccl_inits(path):
            bound = any(kw.arg == "device_id" or kw.arg is None for kw in call.keywords)
            if not bound:
                direct.append(f"{path.relative_to(ROOT)}:{call.lineno}")
    assert direct == [], direct


def test_the_benchmarks_bind_local_rank(monkeypatch):
    from benchmarks import common

    seen = {}
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.setdefault("set_device", d))
    monkeypatch.setattr(
        common.dist, "init_process_group", lambda backend, **kw: seen.update(backend=backend, **kw)
    )
    common.init_process_group("nccl", timeout_s=7)
    assert (
        seen["set_device"] == 5 and seen["device_id"] == torch.device("cuda", 5) and seen["backend"] == "nccl"
    )
    seen.clear()
    common.init_process_group("gloo")
    assert "device_id" not in seen and "set_device" not in seen


def test_the_side_stream_is_made_once_per_device_at_the_highest_priority(monkeypatch):
    """The relay's side stream (EngineState.side_stream): one per device, asked for below every priority
    range (torch clamps it to the device's highest; lower numbers are higher priorities)."""
    from hf_distca.engine.state import SIDE_STREAM_PRIORITY, EngineState

    made = []

    class Stream:
        def __init__(self, device, priority=0):
            made.append((str(device), priority))

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    state = EngineState()
    first = state.side_stream(torch.device("cuda", 0))
    assert state.side_stream(torch.device("cuda", 0)) is first
    state.side_stream(torch.device("cuda", 1))
    assert made == [("cuda:0", SIDE_STREAM_PRIORITY), ("cuda:1", SIDE_STREAM_PRIORITY)]
    assert SIDE_STREAM_PRIORITY <= -8  # past any CUDA range ([-5, 0] on Hopper), so the highest
