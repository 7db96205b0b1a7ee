"""Offloaded checkpoints, kept-attention placements and tiled MLP on a CUDA device: exact, and really moved.

A small Llama (4 layers, hidden 256, float32, TF32 off) on one CUDA device, ~8K tokens of packed documents: one
step with rematerialization-aware checkpointing and each memory option (layer inputs in pinned host memory with
the kept attention outputs on the device, in host memory or dropped; tiled MLP) must give the loss and every
parameter gradient of the step without checkpointing (TOL["train_loss"], TOL["grads"]). The offload must really
free the device: after forward, allocated memory is lower than the same checkpointing without offload by at
least 90% of the checkpointed inputs' bytes; the copies run on a side stream (not the compute stream) into
page-locked host memory. Nothing here asserts timing. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from test_engine_remat import assert_grads_close, grads_of, with_mode
from tolerances import TOL
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, LlamaConfig

from hf_distca.offload_timing import weigh_over_ranks
from hf_distca.offloading import OFFLOAD_ATTR, OffloadOptions, offload_activations
from hf_distca.tiled_mlp import tile_mlp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LAYERS, HIDDEN, VOCAB = 4, 256, 512
LENGTHS = [3000, 1200, 500, 2500, 1000]  # 8200 tokens, packed
OPTIONS = {
    "inputs_gpu": OffloadOptions(inputs=True, kept_attention="gpu", min_bytes=0),
    "inputs_host": OffloadOptions(inputs=True, kept_attention="host", min_bytes=0),
    "inputs_drop": OffloadOptions(inputs=True, kept_attention="drop", min_bytes=0),
}


@pytest.fixture(autouse=True, scope="module")
def _no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # exact float32 matmuls
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def small_llama():
    config = LlamaConfig(
        hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        intermediate_size=512, vocab_size=VOCAB, max_position_embeddings=8192, initializer_range=0.05,
        attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="distca").float().cuda()


def packed_batch() -> dict:
    g = torch.Generator().manual_seed(1)
    docs = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=g).tolist()} for n in LENGTHS]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(docs)
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def step(model, batch) -> tuple[float, dict]:
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    torch.cuda.synchronize()
    return float(loss.detach()), grads_of(model)


def check_equal(got: tuple[float, dict], want: tuple[float, dict], label: str) -> None:
    rtol = TOL["train_loss"][0]
    assert abs(got[0] - want[0]) <= rtol * abs(want[0]), (label, got[0], want[0])
    assert_grads_close(got[1], want[1], label)


@pytest.fixture(scope="module")
def reference():
    base, batch = small_llama(), packed_batch()
    return base, batch, step(with_mode(base, "none"), batch)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_offload_placements_equal_the_run_without_checkpointing(reference, name):
    base, batch, want = reference
    model = with_mode(base, "remat")
    offload = offload_activations(model, OPTIONS[name])
    got = step(model, batch)
    check_equal(got, want, name)
    report = offload.report()
    assert report["offload_inputs_host_layers"] == LAYERS, (
        report
    )  # 4 x 8 MB: every layer fits the host budget
    kept_host = 2 if name == "inputs_host" else 0  # each layer's output and log-sum-exp
    assert report["offloaded_tensors"] == LAYERS * (1 + kept_host), report
    assert report["kept_attention"] == [OPTIONS[name].kept_attention] * LAYERS
    assert report["host_arena_pinned"] and offload.offloader.arena.live == 0, report


def test_tiled_mlp_equals_the_run_without_checkpointing(reference):
    base, batch, want = reference
    model = with_mode(base, "remat")
    assert tile_mlp(model, 1000) == LAYERS  # 9 tiles of the 8200 tokens
    check_equal(step(model, batch), want, "tiled")
    model = with_mode(base, "remat")
    tile_mlp(model, 1000)
    offload_activations(model, inputs=True, kept_attention="host")
    check_equal(step(model, batch), want, "tiled + inputs and kept outputs on host")


def test_offload_frees_the_device_on_a_side_stream(reference):
    base, batch, _ = reference
    allocated = {}
    for name in ("remat", "offload"):
        model = with_mode(base, "remat")
        if name == "offload":
            offload_activations(model, inputs=True, min_bytes=0)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = model(**batch, use_cache=False).loss
        torch.cuda.synchronize()  # every copy to host done (their sources were freed at pack, no later call)
        offload = getattr(model, OFFLOAD_ATTR, None)
        if offload is not None:
            streams = offload.offloader.side_streams
            assert len(streams) == 1 and streams[0] != torch.cuda.current_stream(), streams
            assert offload.offloader.arena._chunks[
                0
            ].pinned  # page-locked (cudaHostRegister): asynchronous copies
        allocated[name] = torch.cuda.memory_allocated() - before
        loss.backward()
        del loss, model
    inputs = LAYERS * sum(LENGTHS) * HIDDEN * 4  # one float32 (T, hidden) input per checkpointed layer
    saved = allocated["remat"] - allocated["offload"]
    assert saved >= 0.9 * inputs, (allocated, inputs)


def test_auto_weighs_host_against_drop_after_the_first_step(reference):
    """kept_attention="auto"'s second look on a real device: the first step times every layer's forward and
    core attention and the copies, the figures land in the report, and the steps before and after the
    weighing (whatever it chose) equal the run without checkpointing."""
    base, batch, want = reference
    model = with_mode(base, "remat")
    offload = offload_activations(
        model, kept_attention="auto", inputs=True, min_bytes=0, working_set_layers=0
    )
    tokens = batch["input_ids"].numel()
    assert offload.resolve(tokens, torch.float32, free_device=0, free_host=1 << 40) == ["host"] * LAYERS
    device = torch.device("cuda")
    assert offload.start_timing(device)
    check_equal(step(model, batch), want, "timed first step")
    policy = weigh_over_ranks(offload, device)
    report = offload.report()
    assert 0 < report["kept_attention_attention_s"] < report["kept_attention_layer_s"], report
    assert all(s > 0 for s in report["kept_attention_copy_s"]), report
    assert report["kept_attention"] == policy and set(policy) <= {"host", "drop"}, report
    assert offload.timer is None and not offload.start_timing(torch.device("cpu"))
    model.zero_grad(set_to_none=True)
    check_equal(step(model, batch), want, f"after weighing: {policy}")
