"""Host reads out of the overlap window (issue 31, outcome 4), what the CPU can check of it.

- The padding mask's verdict (does it mask anything: a host read of a device tensor) is read once per
  mask tensor, where the mask is built, and reused by every layer, not read per layer.
- Under layer-level ping-pong every nano-batch's checks (the consistency all-gather and the plan
  comparison, whose results the host reads) run before the first exchange starts.
- Host-to-device copies of the engine and kernels go through pinned memory on CUDA.
- The engine in a pretended world (tests/fake_world.py, the harness of the GPU test
  tests/test_gpu_sync_free.py) runs forward and backward in every schedule on the CPU: 2 ranks, and for
  the KV relay 4 ranks in 2 nodes of 2, where its two-stage chains run (counted by
  ``EngineStats.exchanges``).
"""

from __future__ import annotations

import importlib
import os
import sys
import types

import numpy as np
import pytest
import torch
from fake_world import SCHEDULES, micro_batch, model_for, pretend_world, train_step
from test_attention_hf import tiny_model

import hf_distca
from hf_distca import DistCAConfig, attention_inputs, enable_distca, kernels, metrics
from hf_distca.attention import distca_attention_forward
from hf_distca.engine import ping_pong
from hf_distca.engine.state import EngineState

prepare_module = importlib.import_module("hf_distca.engine.prepare")  # the module, not the function


@pytest.fixture
def host_reads(monkeypatch) -> list[torch.Tensor]:
    """Every ``bool(tensor)`` of a 0-dim tensor (how a verdict is read on the host) made by hf_distca's
    code, logged (Transformers' own are not ours to count)."""
    seen: list[torch.Tensor] = []
    original = torch.Tensor.__bool__
    package = os.path.dirname(hf_distca.__file__)

    def logged(self):
        if self.dim() == 0 and sys._getframe(1).f_code.co_filename.startswith(package):
            seen.append(self)
        return original(self)

    monkeypatch.setattr(torch.Tensor, "__bool__", logged)
    return seen


@pytest.mark.parametrize("layers", [2, 4])
def test_mask_verdict_is_read_once_per_forward_not_per_layer(host_reads, layers):
    """An all-ones boolean mask: one host read for the whole forward, whatever the number of layers."""
    model = tiny_model("llama", num_hidden_layers=layers)
    ids = torch.randint(0, 128, (1, 12))
    model(input_ids=ids, attention_mask=torch.ones(1, 12, dtype=torch.bool), use_cache=False)
    assert len(host_reads) == 1


def test_mask_verdict_reused_by_the_layers_of_a_distributed_forward(host_reads):
    """A mask that reaches the attention function with a layout (a model whose mask build is not distca's):
    its verdict is read at the first layer and reused by the others; a new mask tensor is read again."""
    module = torch.nn.Module()
    enable_distca(module, config=DistCAConfig(shard_tokens=8))
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    layout = types.SimpleNamespace(pieces=[(0, 0, 6)], all_pieces=[[(0, 0, 6)]])
    mask = torch.ones(1, 6, dtype=torch.bool)
    for _ in range(3):  # three layers
        distca_attention_forward(module, q, k, v, mask, distca_layout=layout)
    assert len(host_reads) == 1
    distca_attention_forward(module, q, k, v, mask.clone(), distca_layout=layout)
    assert len(host_reads) == 2


def test_mask_verdicts_follow_the_tensor_and_its_version():
    state = EngineState()
    mask = torch.ones(2, 5, dtype=torch.bool)
    assert not attention_inputs.mask_has_padding(state, mask)
    mask[1, 0] = False  # in place: a new version, read again
    assert attention_inputs.mask_has_padding(state, mask)
    attention_inputs.remember_mask(state, mask, False)  # a recorded verdict is taken as it is
    assert not attention_inputs.mask_has_padding(state, mask)
    masks = [torch.ones(1, 3, dtype=torch.bool) for _ in range(attention_inputs.MASK_VERDICTS + 4)]
    for m in masks:
        attention_inputs.mask_has_padding(state, m)
    verdicts = state.forward_inputs["mask_verdicts"]
    assert verdicts.get(masks[-1]) is False and verdicts.get(masks[0]) is None  # bounded, oldest out


def test_checks_of_every_nano_batch_run_before_the_first_exchange(monkeypatch):
    """Layer-level ping-pong with new layouts: all the all-gathers (each nano-batch's consistency check and
    plan comparison, read on the host) come before the first all-to-all, so none waits behind an exchange."""
    model = model_for("cpu", layer_ping_pong=True)
    batch = micro_batch("cpu", layer_ping_pong=True)
    with pretend_world(monkeypatch) as log:
        train_step(model, batch)
    first_exchange = log.index("all_to_all")
    assert log.count("all_gather") == 4  # 2 nano-batches x (layout check + plan comparison)
    assert "all_gather" not in log[first_exchange:], log


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_pretended_world_runs_every_schedule(monkeypatch, schedule):
    """The GPU test's harness on the CPU: a step plans and checks (all-gathers), the same batch again
    reuses both (only exchanges), and both run forward and backward to finite numbers. Every engine call
    starts the exchanges of its schedule (fake_world.SCHEDULES): with the KV relay (4 ranks in 2 nodes of
    2) its KV phases ran as two-stage chains, 7 exchanges a call where the direct route starts 4."""
    fields, world, exchanges_per_call = SCHEDULES[schedule]
    model = model_for("cpu", **fields)
    batch = micro_batch("cpu", layer_ping_pong=fields.get("layer_ping_pong", False), world=world)
    metrics.reset()
    with pretend_world(monkeypatch, world=world) as log:
        assert torch.isfinite(train_step(model, batch))
        first = len(log)
        assert torch.isfinite(train_step(model, batch))
    assert "all_gather" in log[:first] and "all_to_all" in log[:first]
    assert set(log[first:]) == {"all_to_all"}  # the second step: no check, no plan comparison
    stats = metrics.snapshot()
    calls, exchanges = stats.calls, stats.exchanges
    assert calls > 0 and exchanges == exchanges_per_call * calls, (exchanges, calls)
    assert exchanges == log.count("all_to_all")


# ------------------------------------------------------------------------------------------- copies
class _Host:
    """A stand-in for a host tensor that logs what is done to it (no CUDA here)."""

    device = torch.device("cpu")

    def __init__(self, log: list) -> None:
        self.log = log

    def pin_memory(self):
        self.log.append("pin_memory")
        return self

    def to(self, device, non_blocking=False):
        self.log.append(("to", str(device), non_blocking))
        return "on device"


def test_host_to_device_pins_for_cuda_and_copies_asynchronously():
    log: list = []
    assert kernels.host_to_device(_Host(log), torch.device("cuda", 0)) == "on device"
    assert log == ["pin_memory", ("to", "cuda:0", True)]
    host = torch.arange(3)
    assert kernels.host_to_device(host, torch.device("cpu")) is host  # nothing to copy


def test_engine_index_copies_go_through_host_to_device(monkeypatch):
    """The prepared index tensors and the ping-pong parts' order: every host-to-device copy pinned."""
    calls: list = []

    def counted(host, device):
        calls.append(tuple(host.shape))
        return host.to(device)

    monkeypatch.setattr(prepare_module, "host_to_device", counted)
    monkeypatch.setattr(ping_pong, "host_to_device", counted)
    prep = prepare_module.prepare(
        *(torch.randn(20, 2, 8) for _ in range(3)), [(0, 0, 20)], config=DistCAConfig(shard_tokens=4),
        state=EngineState(),
    )  # fmt: skip
    prep.device_index(torch.device("cpu"))
    assert len(calls) == 6  # every index array but the relay's (none here)
    split = ping_pong.PartSplit((prep,), (np.arange(20),))
    split.local_order(torch.device("cpu"))
    assert len(calls) == 7
