"""Every DistCAConfig flag against every attention mode of the callback (and so of the recipes' ``--attn``):
it takes effect, or the run is refused before training with a message naming it."""

from __future__ import annotations

import dataclasses

import pytest
from test_callback import dataset, tiny_llama, trainer_args

import hf_distca
from hf_distca.attention import RUNTIME_ATTR
from hf_distca.config import ATTENTION_FUNCTION_FIELDS, DATA_PATH_FIELDS
from hf_distca.kernels import UnsupportedFeatureError

# a valid value other than the default for every field, with what it needs set beside it
NON_DEFAULT = {
    "tolerance": {"tolerance": 0.05},
    "shard_tokens": {"shard_tokens": 64},
    "max_recv_bytes_per_server": {"max_recv_bytes_per_server": 1 << 30},
    "backend": {"backend": "reference"},
    "max_planner_moves": {"max_planner_moves": 10},
    "cost_table": {"cost_table": None},
    "link_gib_per_s": {"link_gib_per_s": 50.0},
    "intra_node_gib_per_s": {"intra_node_gib_per_s": 300.0},
    "ranks_per_node": {"ranks_per_node": 1},
    "kv_relay": {"kv_relay": True, "ranks_per_node": 1},
    "comm_overlap": {"comm_overlap": 0.5},
    "layer_seconds_per_token": {"layer_seconds_per_token": 4e-6, "layer_ping_pong": True},
    "layer_tflops": {"layer_tflops": 400.0},
    "attention_tflops": {"attention_tflops": 200.0},
    "max_send_bytes_per_rank": {"max_send_bytes_per_rank": 1 << 30},
    "measure_link": {"measure_link": True},
    "check_consistency": {"check_consistency": False},
    "ping_pong": {"ping_pong": True},
    "ping_pong_split": {"ping_pong_split": "halves"},
    "layer_ping_pong": {"layer_ping_pong": True},
    "prefetch_plans": {"prefetch_plans": True},
    "pad_to_budget": {"pad_to_budget": True},
}
# --attn of the recipes: (attn_implementation, disaggregate)
MODES = {"local": ("distca", False), "sdpa": ("sdpa", False)}


def test_every_field_is_enumerated():
    assert set(NON_DEFAULT) == {f.name for f in dataclasses.fields(hf_distca.DistCAConfig)}


def _trainer(tmp_path, mode: str, **config) -> hf_distca.DistCATrainer:
    attn, disaggregate = MODES[mode]
    callback = hf_distca.DistCACallback(
        512, config=hf_distca.DistCAConfig(**config), disaggregate=disaggregate
    )
    return hf_distca.DistCATrainer(
        model=tiny_llama(attn), args=trainer_args(tmp_path), train_dataset=dataset(), callbacks=[callback]
    )


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_flag_takes_effect_or_is_refused_by_name(tmp_path, mode, name):
    live = DATA_PATH_FIELDS + (ATTENTION_FUNCTION_FIELDS if MODES[mode][0] == "distca" else ())
    if name in live:
        _trainer(tmp_path, mode, **NON_DEFAULT[name])  # accepted: its effect is tested below
        return
    flag = "--" + name.replace("_", "-")
    with pytest.raises(ValueError, match=rf"{name}=.*\({flag}\).*no effect under"):
        _trainer(tmp_path, mode, **NON_DEFAULT[name])


@pytest.mark.parametrize("mode", sorted(MODES))
def test_pad_to_budget_lays_out_every_mode(tmp_path, mode):
    widths = {
        pad: next(iter(_trainer(tmp_path / str(pad), mode, pad_to_budget=pad).distca_callback.batches))[
            "input_ids"
        ].shape[1]
        for pad in (False, True)
    }
    assert widths[True] == 512 > widths[False]


def test_local_attention_runs_the_callbacks_config(tmp_path):
    """Without disaggregation the distca attention function still runs the config's kernel backend."""
    trainer = _trainer(tmp_path, "local", backend="reference")
    trainer.train()
    for module in trainer.model.modules():
        assert getattr(module, RUNTIME_ATTR).config.backend == "reference"


@pytest.mark.parametrize("backend", ["cudnn", "flash_attn"])
def test_a_backend_that_cannot_run_is_refused_before_training_in_local_mode(tmp_path, backend):
    with pytest.raises(UnsupportedFeatureError, match=f"kernel backend '{backend}' cannot run here"):
        _trainer(tmp_path, "local", backend=backend)


# ------------------------------------------------------------------ memory options (DistCACallback's)
# --offload-activations, --kept-attention, --tiled-mlp of the recipes: callback argument, and what must be true
# of DistCACallback.memory_report after a step where it takes effect
MEMORY_FLAGS = {
    "offload_activations": (
        {"offload": hf_distca.OffloadOptions(inputs=True, min_bytes=0)},
        lambda r: r["offloaded_tensors"] > 0,
    ),
    "kept_attention_host": (
        {"offload": hf_distca.OffloadOptions(kept_attention="host", min_bytes=0)},
        lambda r: r["kept_attention_host_layers"] == 2 and r["offloaded_tensors"] > 0,
    ),
    "kept_attention_drop": (
        {"offload": hf_distca.OffloadOptions(kept_attention="drop")},
        lambda r: r["kept_attention_drop_layers"] == 2,
    ),
    "kept_attention_auto": (
        {"offload": hf_distca.OffloadOptions(kept_attention="auto")},
        lambda r: len(r["kept_attention"]) == 2,
    ),
    "tiled_mlp": ({"tiled_mlp": 0}, lambda r: r["tiled_mlps"] == 2 and r["tiled_mlp_tokens"] == 32),
    # two norms in each of the 2 decoder layers and the final norm
    "tiled_norms": ({"tiled_norms": 0}, lambda r: r["tiled_norms"] == 5 and r["tiled_norm_tokens"] == 32),
}
MEMORY_MODES = {"distca": ("distca", True), **MODES}


def _memory_trainer(tmp_path, mode: str, checkpointing: bool, **callback_kwargs):
    attn, disaggregate = MEMORY_MODES[mode]
    config = hf_distca.DistCAConfig(shard_tokens=32) if disaggregate else None  # the engine's field
    callback = hf_distca.DistCACallback(512, config=config, disaggregate=disaggregate, **callback_kwargs)
    args = trainer_args(tmp_path, max_steps=1, activation_checkpointing=checkpointing)
    trainer = hf_distca.DistCATrainer(
        model=tiny_llama(attn), args=args, train_dataset=dataset(), callbacks=[callback]
    )
    return trainer, callback


@pytest.mark.parametrize("mode", sorted(MEMORY_MODES))
@pytest.mark.parametrize("name", sorted(MEMORY_FLAGS))
def test_memory_flag_takes_effect_or_is_refused_by_name(tmp_path, mode, name):
    kwargs, took_effect = MEMORY_FLAGS[name]
    if name.startswith("kept_attention") and MEMORY_MODES[mode][0] != "distca":
        with pytest.raises(ValueError, match=r"kept_attention=.*\(--kept-attention\): no effect under"):
            _memory_trainer(tmp_path, mode, True, **kwargs)
        return
    trainer, callback = _memory_trainer(tmp_path, mode, True, **kwargs)
    trainer.train()
    assert took_effect(callback.memory_report), callback.memory_report


@pytest.mark.parametrize("name", ["offload_activations", "kept_attention_host"])
def test_offload_without_checkpointing_or_with_plain_recompute_is_refused(tmp_path, name):
    kwargs, _ = MEMORY_FLAGS[name]
    with pytest.raises(ValueError, match=r"\(--offload-activations, --kept-attention\): no effect without"):
        _memory_trainer(tmp_path, "local", False, **kwargs)
    if name == "kept_attention_host":
        with pytest.raises(ValueError, match="recompute_attention / --recompute-attention"):
            _memory_trainer(tmp_path, "local", True, recompute_attention=True, **kwargs)


def test_memory_flags_with_torch_compile_are_refused(tmp_path):
    callback = hf_distca.DistCACallback(512, disaggregate=False, tiled_mlp=0)
    args = trainer_args(tmp_path, max_steps=1, torch_compile=True, torch_compile_backend="aot_eager")
    with pytest.raises(
        ValueError, match=r"--tiled-norms\) are not traced by torch.compile.*leave out --torch-compile"
    ):
        hf_distca.DistCATrainer(model=tiny_llama(), args=args, train_dataset=dataset(), callbacks=[callback])
