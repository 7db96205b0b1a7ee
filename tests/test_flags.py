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
