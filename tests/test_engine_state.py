"""The engine's state has one owner (hf_distca.engine.state.EngineState): no engine or integration module
keeps caches of its own, the engine's functions use the state they are given, and the one reset forgets
what was derived from inputs while keeping what the ranks agreed on together."""

from __future__ import annotations

import ast
import pathlib

import torch

import hf_distca
from hf_distca import DistCAConfig, core_attention, enable_distca
from hf_distca.engine import EngineState, engine_state, prepare
from hf_distca.engine.state import CheckedLayout, group_key

ROOT = pathlib.Path(hf_distca.__file__).parent
# modules of the engine and the Transformers integration (the kernels' graph caches and the metrics
# counters live in lower layers)
CHECKED = [*sorted((ROOT / "engine").glob("*.py")), *(ROOT / f for f in (
    "attention.py", "attention_inputs.py", "callback.py", "checkpointing.py", "step_records.py", "trainer.py",
    "nano_batches.py"))]  # fmt: skip
# per-thread context stacks (the active checkpoint frames, the interleaved forward's turn), not caches,
# and the process's one engine state
ALLOWED = {("remat.py", "_state"), ("interleave.py", "_local"), ("state.py", "_process_state")}
MUTABLE_CALLS = {"dict", "list", "set", "OrderedDict", "WeakValueDictionary", "WeakKeyDictionary", "local",
                 "count", "Lock", "Future", "deque", "defaultdict"}  # fmt: skip


def _module_state(path: pathlib.Path) -> list[str]:
    """Names of module-level state: bound at module level to a mutable value (a display or a call of a
    mutable type) under a lower-case name (upper case: a constant table), or rebound through ``global``."""
    tree = ast.parse(path.read_text())
    found = {n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names}
    for node in tree.body:
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        for target in targets:
            if not isinstance(target, ast.Name) or target.id.lstrip("_").isupper() or target.id == "__all__":
                continue
            call = value.func if isinstance(value, ast.Call) else None
            name = getattr(call, "attr", getattr(call, "id", None))
            if isinstance(value, (ast.Dict, ast.List, ast.Set)) or name in MUTABLE_CALLS:
                found.add(target.id)
    return sorted(found)


def test_no_module_keeps_engine_state():
    held = {(p.name, n) for p in CHECKED for n in _module_state(p)}
    assert held == ALLOWED, sorted(held - ALLOWED)


def test_no_cache_is_keyed_by_object_identity():
    for path in CHECKED:
        assert "id(" not in path.read_text().replace("_id(", ""), path.name


def test_the_engine_uses_the_state_it_is_given_and_one_reset():
    q, k = torch.randn(40, 2, 8, dtype=torch.float64), torch.randn(40, 1, 8, dtype=torch.float64)
    state, before = EngineState(), len(engine_state().plans)
    config = DistCAConfig(shard_tokens=8, backend="reference")
    prepared = prepare(q, k, k, [(0, 0, 40)], config=config, state=state)
    assert len(state.plans) == 1 and len(engine_state().plans) == before  # cached in the given state only
    assert prepare(q, k, k, [(0, 0, 40)], config=config, state=state) is prepared  # a cache hit
    layout = object()
    state.checked_layouts.append(CheckedLayout(layout, group_key(None), [], 0))
    state.link_gib_per_s[group_key(None)] = 1.0
    state.forward_inputs["local"] = object()
    state.reset()
    assert not state.plans and not state.runners and not state.forward_inputs
    # what ranks agreed on together is kept (a rank-local reset must not change which collectives run)
    assert state.checked_layouts[0].obj is layout and state.link_gib_per_s == {(): 1.0}


def test_a_model_runtime_holds_the_process_state():
    module = torch.nn.Linear(2, 2)
    runtime = enable_distca(module)
    assert runtime.state is engine_state() and module.distca_runtime is runtime
    q, k = torch.randn(16, 2, 8, dtype=torch.float64), torch.randn(16, 1, 8, dtype=torch.float64)
    out = core_attention(q, k, k, [(0, 0, 16)], config=DistCAConfig(shard_tokens=8, backend="reference"),
                         state=runtime.state)  # fmt: skip
    assert out.shape == q.shape
