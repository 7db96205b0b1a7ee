"""Weights, optimizer and activations off the device under every parallelism, on 2 CPU processes (gloo,
fp32), equal to one process.

Weights and optimizer: ``accelerate_configs/ds_zero3_offload.json`` (DeepSpeed ZeRO-3 with ``offload_param``
and ``offload_optimizer`` on the CPU) through ``recipes/finetune_long_docs.py --deepspeed``, with the
Trainer's SGD instead of the config's AdamW (as tests/test_parallelisms.py does for ds_zero3.json);
``accelerate_configs/fsdp2_offload.yaml``'s FSDP2 ``CPUOffloadPolicy`` around torch's ``fully_shard`` in
the training loop of tests/test_parallelisms.py (the Trainer runs FSDP only on accelerators). Activations:
the recipe's ``--gradient-checkpointing --offload-activations --kept-attention drop,host --tiled-mlp``
under DDP, ZeRO-3 and ZeRO-3 with offload, and hf_distca.offload_activations + tile_mlp in the FSDP2 loop
(with and without CPUOffloadPolicy). Every run: the per-step losses and final weights of the one-process
run without any of it (TOL["train_loss"], TOL["train_weights"]).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from extras import require
from run_recipes import exact_run_args, launch
from test_parallelisms import ROOT, _results
from tolerances import TOL

BUDGET = 5120  # tokens per micro-batch over all ranks: 2560 a rank, layer inputs over 1 MiB (offloaded)
COMMON = exact_run_args(max_steps=2, num_documents=100)
ACTIVATIONS = ["--gradient-checkpointing", "--offload-activations", "--kept-attention", "drop,host"]
MEMORY = [*ACTIVATIONS, "--tiled-mlp", "64"]


def _sgd_config(name: str, path) -> str:
    """accelerate_configs/``name`` with the Trainer's optimizer (``--optim sgd``) instead of its AdamW:
    ZeRO then steps a torch optimizer on its flat fp32 partitions (on the CPU when the optimizer is
    offloaded, which DeepSpeed allows for a client optimizer only with ``zero_force_ds_cpu_optimizer``
    off)."""
    with open(os.path.join(ROOT, "accelerate_configs", name)) as f:
        config = json.load(f)
    del config["optimizer"]
    config["zero_allow_untested_optimizer"] = True
    config["zero_force_ds_cpu_optimizer"] = False
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.slow
def test_zero3_offload_and_activation_offload_recipe_match_one_process(tmp_path):
    require("deepspeed", "deepspeed")
    offload = _sgd_config("ds_zero3_offload.json", tmp_path / "offload_sgd.json")
    zero3 = _sgd_config("ds_zero3.json", tmp_path / "zero3_sgd.json")
    reference = tmp_path / "reference"
    launch(1, [["finetune_long_docs.py", [*COMMON, "--tokens-per-rank", str(BUDGET), "--output-dir",
                                           str(reference)]]], tmp_path)  # fmt: skip
    modes = {
        "ddp_memory": MEMORY,
        "zero3_memory": ["--deepspeed", zero3, *ACTIVATIONS],
        "zero3_offload": ["--deepspeed", offload],
        "zero3_offload_memory": ["--deepspeed", offload, *ACTIVATIONS],
    }
    launch(2, [
        ["finetune_long_docs.py", [*COMMON, "--tokens-per-rank", str(BUDGET // 2), *flags, "--output-dir",
                                   str(tmp_path / name)]]
        for name, flags in modes.items()
    ], tmp_path)  # fmt: skip
    ref_records, ref_weights, _ = _results(reference)
    assert [r["step"] for r in ref_records] == [1, 2] and ref_records[-1]["loss"] < ref_records[0]["loss"]
    for name, flags in modes.items():
        records, weights, summary = _results(tmp_path / name)
        wrapped = "DeepSpeedEngine" if "--deepspeed" in flags else "DistributedDataParallel"
        assert summary["world_size"] == 2 and summary["wrapped"] == wrapped, (name, summary)
        # ZeRO-3 kept the weights and the optimizer state in host memory with the offload config only
        offloaded = offload in flags
        assert summary["zero_offload"] == {"param": offloaded, "optimizer": offloaded}, (name, summary)
        if "--offload-activations" in flags:  # the memory options acted
            report = summary["memory"]
            assert report["kept_attention"] == ["drop", "host"], (name, report)
            assert report.get("tiled_mlps", 0) == (2 if "--tiled-mlp" in flags else 0), (name, report)
            assert report["offloaded_tensors"] > 0, (name, report)
        assert [r["step"] for r in records] == [1, 2], name
        for got, want in zip(records, ref_records, strict=True):
            assert got["tokens"] == want["tokens"] == BUDGET * 2
            assert abs(got["loss"] - want["loss"]) <= TOL["train_loss"][0] * abs(want["loss"]), (
                name,
                got,
                want,
            )
            assert sum(got["bytes_sent"]) > 0, (
                name,
                got,
            )  # documents cut over ranks: the engine communicated
        assert weights.keys() == ref_weights.keys()
        for key, w in weights.items():
            torch.testing.assert_close(
                w, ref_weights[key], rtol=0, atol=TOL["train_weights"][1], msg=f"{name} {key}"
            )


def test_recipe_refuses_tiled_mlp_under_zero3_on_every_rank(tmp_path):
    """--tiled-mlp under ZeRO-3 (with or without offload) would fail in backward (its tiles' gradients have
    the full shapes of parameters ZeRO-3 has partitioned again): every rank refuses it before training."""
    require("deepspeed", "deepspeed")
    offload = _sgd_config("ds_zero3_offload.json", tmp_path / "offload_sgd.json")
    argv = [
        *COMMON,
        "--tokens-per-rank",
        "512",
        "--deepspeed",
        offload,
        *MEMORY,
        "--output-dir",
        str(tmp_path / "o"),
    ]
    with pytest.raises(AssertionError) as failed:
        launch(2, [["finetune_long_docs.py", argv]], tmp_path)
    report = str(failed.value)
    for rank in (0, 1):
        section = report.split(f"--- rank {rank}")[1].split("--- rank")[0]
        assert "(--tiled-mlp) does not run under DeepSpeed ZeRO-3" in section, report


# ------------------------------------------------ FSDP2 (torch's fully_shard) with CPUOffloadPolicy, in a loop
def _fsdp2_offload_worker(rank: int, world: int) -> dict:
    from test_parallelisms import _train_loop

    runs = {
        "offload": dict(offload=True),
        "memory": dict(memory=True),
        "offload_memory": dict(offload=True, memory=True),
    }
    return {name: _train_loop(rank, world, ping_pong=False, shard=True, **kw) for name, kw in runs.items()}


@pytest.mark.slow
def test_fsdp2_cpu_offload_and_activation_offload_loop_match_one_process():
    """accelerate_configs/fsdp2_offload.yaml's CPUOffloadPolicy (shards in host memory, the optimizer stepping
    there) and the activation options (offloaded layer inputs, kept attention dropped and in host memory,
    tiled MLP), alone and together, on 2 gloo processes: the unsharded single-process run's losses and final
    weights. (The Trainer runs FSDP only on accelerators; this is the composition itself.)"""
    from distributed import run_distributed
    from test_parallelisms import LOOP_ACCUM, LOOP_STEPS, _train_loop, assert_matches_reference

    reference = _train_loop(0, 1, ping_pong=False, shard=False)
    assert len(reference["losses"]) == LOOP_STEPS and reference["losses"][-1] < reference["losses"][0]
    for rank, runs in enumerate(run_distributed(_fsdp2_offload_worker, 2, timeout=600.0)):
        for name, run in runs.items():
            assert len(run["sharded"]) == len(run["weights"]), (rank, name)  # FSDP2 sharded every parameter
            # the activation options acted: every layer input and layer 1's kept output and log-sum-exp
            micro_batches = LOOP_STEPS * LOOP_ACCUM
            assert run["offloaded_tensors"] == (0 if name == "offload" else micro_batches * 4), (
                rank,
                name,
                run,
            )
            # FSDP2 kept the shards of its 3 units (2 layers, the root) in host memory, or none of them
            assert run["offloaded_units"] == (3 if "offload" in name else 0), (
                rank,
                name,
                run["offloaded_units"],
            )
            assert_matches_reference(run, reference, f"rank {rank} {name}")
            assert run["bytes_sent"] > 0, (rank, name)


@pytest.mark.slow
def test_shipped_zero3_offload_config_with_its_adamw_matches_one_process(tmp_path):
    """accelerate_configs/ds_zero3_offload.json as shipped (its AdamW, torch's on the CPU: "torch_adam", so
    DeepSpeed builds no CPUAdam op) on 2 processes: the losses and final weights of one process with the
    Trainer's AdamW (adamw_torch) and the same hyperparameters."""
    require("deepspeed", "deepspeed")
    common = [*exact_run_args(max_steps=2, num_documents=60), "--learning-rate", "1e-3"]
    common.remove("--optim"), common.remove("sgd")  # the default, adamw_torch; the config's AdamW on ZeRO-3
    config = os.path.join(ROOT, "accelerate_configs", "ds_zero3_offload.json")
    launch(1, [["finetune_long_docs.py", [*common, "--tokens-per-rank", "2048", "--output-dir", str(tmp_path / "ref")]]],
           tmp_path)  # fmt: skip
    launch(2, [["finetune_long_docs.py", [*common, "--tokens-per-rank", "1024", "--deepspeed", config, "--output-dir",
                                          str(tmp_path / "zero3")]]], tmp_path)  # fmt: skip
    ref_records, ref_weights, _ = _results(tmp_path / "ref")
    records, weights, summary = _results(tmp_path / "zero3")
    assert summary["wrapped"] == "DeepSpeedEngine" and summary["zero_offload"] == {
        "param": True,
        "optimizer": True,
    }
    assert [r["step"] for r in records] == [r["step"] for r in ref_records] == [1, 2]
    for got, want in zip(records, ref_records, strict=True):
        assert abs(got["loss"] - want["loss"]) <= TOL["train_loss"][0] * abs(want["loss"]), (got, want)
    for key, w in weights.items():
        torch.testing.assert_close(w, ref_weights[key], rtol=0, atol=TOL["train_weights_adamw"][1], msg=key)
    # AdamW's first steps move each trained weight by about lr (1e-3), 50 times the tolerance
    assert ref_records[-1]["loss"] < ref_records[0]["loss"]
