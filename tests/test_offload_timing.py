"""kept_attention="auto"'s second look (hf_distca.offload_timing): the rule that turns a host layer into a
dropped one, the policy change on a model (still exact), and the ranks' figures combined. The timing
itself (CUDA events, pinned copies) runs in tests/test_gpu_offload.py."""

from __future__ import annotations

import pytest
import torch
from test_engine_remat import LAYERS, assert_grads_close, grads_of, local_batch, tiny_llama, with_mode
from tolerances import TOL

from hf_distca import offload_timing
from hf_distca.offload_timing import weigh_host_against_drop, weigh_over_ranks
from hf_distca.offloading import offload_activations

NONE = (0.0, 0.0)


@pytest.mark.parametrize(
    ("attention", "layer", "kept", "other", "want"),
    [
        (0.1, 1.0, (0.5, 0.5), NONE, "host"),  # copies hide behind the layer: free
        (0.1, 1.0, (1.2, 1.2), NONE, "drop"),  # 0.2 + 0.2 exposed > 0.1 of attention
        (0.5, 1.0, (1.2, 1.2), NONE, "host"),  # 0.4 exposed < 0.5 of attention
        (0.1, 1.0, (0.5, 0.5), (0.8, 0.8), "drop"),  # the input's copies take the window: 0.3 + 0.3 added
        (0.1, 1.0, (0.5, 0.0), (2.0, 0.0), "drop"),  # already exposed: all of the kept copy adds
        (None, 1.0, (9.0, 9.0), NONE, "host"),  # attention not measured: the choice stays
        (0.1, None, (9.0, 9.0), NONE, "host"),
    ],
)
def test_host_layer_drops_where_its_copies_cost_more_than_its_attention(attention, layer, kept, other, want):
    policy = weigh_host_against_drop(["host"], [attention], [layer], kept, [other])
    assert policy == [want]


def test_only_host_layers_are_weighed():
    policy = ["drop", "host", "gpu"]
    cheap_attention = weigh_host_against_drop(policy, [0.0] * 3, [0.0] * 3, (1.0, 1.0), [NONE] * 3)
    assert cheap_attention == ["drop", "drop", "gpu"]


def _auto_model(tokens: int):
    model = with_mode(tiny_llama(), "remat")
    offload = offload_activations(
        model, kept_attention="auto", inputs=True, working_set_layers=0, min_bytes=0
    )
    policy = offload.resolve(tokens, torch.float32, free_device=0, free_host=1 << 40)  # no device room: host
    assert policy == ["host"] * LAYERS
    return model, offload


def test_weighed_policy_changes_the_next_step_and_stays_exact():
    """A policy changed between steps (host -> drop on the layers whose copies were slow) takes effect on
    the next step, which equals the run without checkpointing, and the report says what changed."""
    batch = local_batch()
    reference = with_mode(tiny_llama(), "none")
    loss_ref = reference(**batch, use_cache=False).loss
    loss_ref.backward()
    model, offload = _auto_model(batch["input_ids"].numel())
    copy_rate = 10.0 / max(offload.kept_layer_bytes, 1)  # 10 s a kept copy each way: past any layer below
    attention_s = [100.0] + [0.1] * (LAYERS - 1)  # the first layer's attention costs more than its copies
    policy = offload.weigh(attention_s, [1.0] * LAYERS, (copy_rate, copy_rate))
    assert policy == ["host"] + ["drop"] * (LAYERS - 1)
    report = offload.report()
    assert report["kept_attention"] == policy and report["kept_attention_weighed_to_drop"] == LAYERS - 1
    assert report["kept_attention_copy_s"] == pytest.approx([10.0, 10.0])
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    rtol = TOL["train_loss"][0]
    assert abs(float(loss.detach()) - float(loss_ref.detach())) <= rtol * abs(float(loss_ref.detach()))
    assert_grads_close(grads_of(model), grads_of(reference), "weighed")
    assert offload.report()["offloaded_tensors"] == LAYERS + 2  # every input, one layer's output and lse


class _Timer:
    def __init__(self, attention, layer):
        self.figures = attention, layer

    def seconds(self):
        return self.figures


def test_weigh_over_ranks_gives_the_offload_the_ranks_figures(monkeypatch):
    """One process: the timer's per-layer figures (None kept as not measured) and the copy rates reach
    ``weigh``; the timer is used once."""
    _, offload = _auto_model(64)
    seen = {}
    monkeypatch.setattr(offload_timing, "copy_seconds", lambda nbytes, device: (nbytes * 2e-9, nbytes * 4e-9))
    monkeypatch.setattr(offload, "weigh", lambda a, t, r: seen.update(a=a, t=t, r=r) or ["host"] * LAYERS)
    attention = [0.25, None] + [0.5] * (LAYERS - 2)
    layer = [1.0] * LAYERS
    offload.timer = _Timer(attention, layer)
    assert weigh_over_ranks(offload, torch.device("cpu")) == ["host"] * LAYERS
    assert seen["a"] == attention and seen["t"] == layer
    assert seen["r"] == pytest.approx((2e-9, 4e-9), rel=1e-3)
    assert offload.timer is None and weigh_over_ranks(offload, torch.device("cpu")) is None


def test_nothing_is_timed_off_cuda_or_for_a_fixed_policy():
    _, offload = _auto_model(64)
    assert not offload.start_timing(torch.device("cpu")) and offload.timer is None
    fixed = offload_activations(with_mode(tiny_llama(), "remat"), kept_attention="host")
    assert not fixed.start_timing(torch.device("cuda"))
