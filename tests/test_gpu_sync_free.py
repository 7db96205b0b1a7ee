"""No host synchronisation in the engine's per-layer path on CUDA (issue 31, outcome 4). Skipped without CUDA.

A tiny bf16 Llama on one GPU, in one process, the engine pretending to be rank 0 of 2 (tests/fake_world.py:
the checks' all-gathers agree, the all-to-alls zero what they receive on the issuing stream, ``wait()``
does not touch the host, as NCCL's), in every schedule (fake_world.SCHEDULES): serial, attention-level
ping-pong, layer-level ping-pong and the KV relay, there rank 0 of 4 in 2 nodes of 2 (with one rank a
node the relay forwards nothing), whose KV phases run as two-stage chains, the second stage from the side
stream (``EngineStats.exchanges``: 7 a call, not 4). A first step plans, checks the layout and compares the
plan (host reads allowed: the prepare stage); the same micro-batch again reuses all of it, and there every
engine call of the forward (under layer-level ping-pong: its prepare and each stage, see
:func:`_watch_the_engine`) and every engine node's backward run under ``torch.cuda.set_sync_debug_mode("error")``:
any synchronising CUDA call (``.item()``, ``.cpu()``, ``bool(tensor)``, a blocking copy, nonzero) in the
attention function, the engine's stages, the exchanges or the kernels raises.

    python -m pytest -x --timeout 300 tests/test_gpu_sync_free.py
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import pytest
import torch
from fake_world import SCHEDULES, micro_batch, model_for, pretend_world, train_step

from hf_distca import attention as attention_module
from hf_distca import metrics
from hf_distca.engine import layer_op, stages

op_module = importlib.import_module("hf_distca.engine.op")
DEVICE = "cuda"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@contextlib.contextmanager
def syncs_raise():
    """``torch.cuda.set_sync_debug_mode("error")`` inside, the previous mode restored after."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def _watched(fn):
    """``fn`` with every call under :func:`syncs_raise`."""

    @functools.wraps(fn)
    def watched(*args, **kwargs):
        with syncs_raise():
            return fn(*args, **kwargs)

    return watched


STAGES = (
    "dispatch", "compute", "return_outputs", "gather_outputs",
    "dispatch_backward", "compute_backward", "return_grads", "gather_grads",
)  # fmt: skip


def _watch_the_engine(monkeypatch, interleaved: bool) -> None:
    """Every engine call of a forward and every engine node's backward under :func:`syncs_raise`. Under layer-level ping-pong a call passes
    the turn to the other nano-batch (its Transformers code, not ours, runs then), and the debug mode is the
    process's: there the watch is on the call's prepare and on each stage (the op's and the interleaved
    nodes' both call them through the stages module) instead of the whole call."""
    monkeypatch.setattr(op_module, "prepare", _watched(op_module.prepare))
    for name in STAGES:
        monkeypatch.setattr(stages, name, _watched(getattr(stages, name)))
    if not interleaved:
        monkeypatch.setattr(attention_module, "core_attention", _watched(attention_module.core_attention))
    # backward: each engine node's whole backward (autograd looks it up on the class at each call); the
    # rest of the model's backward is PyTorch's (an embedding's backward reads a count on the host)
    for node in (op_module._AttentionOp, layer_op._Dispatch, layer_op._Serve, layer_op._Return):
        monkeypatch.setattr(node, "backward", staticmethod(_watched(node.backward)))


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_engine_layers_do_not_synchronise_after_planning(monkeypatch, schedule, backend):
    fields, world, exchanges_per_call = SCHEDULES[schedule]
    torch.cuda.set_device(0)
    model = model_for(DEVICE, backend=backend, **fields)
    batch = micro_batch(DEVICE, layer_ping_pong=fields.get("layer_ping_pong", False), world=world)
    metrics.reset()
    with pretend_world(monkeypatch, world=world) as log:
        first = train_step(model, batch)  # plans, checks, builds kernel graphs: host reads allowed here
        checked = len(log)
        model.zero_grad(set_to_none=True)
        _watch_the_engine(monkeypatch, interleaved=fields.get("layer_ping_pong", False))
        second = train_step(model, batch)
    torch.cuda.synchronize()
    assert "all_gather" in log[:checked]  # the first step checked and compared
    assert log[checked:] and set(log[checked:]) == {"all_to_all"}  # the second: only the exchanges
    assert torch.isfinite(first) and torch.isfinite(second)
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    # every call started its schedule's exchanges: with the relay, its KV phases as two-stage chains
    stats = metrics.snapshot()
    calls, exchanges = stats.calls, stats.exchanges
    assert calls > 0 and exchanges == exchanges_per_call * calls, (exchanges, calls)
