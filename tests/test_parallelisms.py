"""DistCA under parameter-sharding parallelisms on 2 CPU processes (gloo, fp32) equals 1 process.

DeepSpeed ZeRO-3: ``recipes/finetune_long_docs.py --deepspeed`` (the repository's
``accelerate_configs/ds_zero3.json`` with the Trainer's optimizer instead of its AdamW), ping-pong off,
attention-level and layer-level (with gradient checkpointing), documents cut over the ranks, gradient
accumulation, and on 4 processes in 2 "nodes" layer-level with KV through the relay: the same per-step
losses and the same final (gathered, saved) weights as the single-process run on the same global batches
(``--tokens-per-rank 2T`` on 1 process, ``T`` on 2, ``T / 2`` on 4).

FSDP2: Accelerate (1.15) turns FSDP on only for accelerator devices (``MULTI_GPU``, ...); on the CPU the
Trainer trains with DDP whatever ``fsdp``/``fsdp_config`` or an ``accelerate launch`` FSDP config asks
for, so the recipe refuses that combination (tested below) instead of reporting DDP results as FSDP2
ones. What runs on the CPU is torch's ``fully_shard`` itself around a model with DistCA attention, in the
training loop of ``recipes/accelerate_loop.py``, against the unsharded single-process run.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from extras import require
from run_recipes import exact_run_args, launch
from tolerances import TOL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(ROOT, "recipes")
BUDGET = 2048  # tokens per micro-batch over all ranks
COMMON = exact_run_args(max_steps=2, num_documents=60)


def _results(out) -> tuple[list[dict], dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    weights = load_file(str(out / "model" / "model.safetensors"))
    return records, weights, json.loads((out / "summary.json").read_text())


def _zero3_sgd_config(path) -> str:
    """accelerate_configs/ds_zero3.json without its optimizer section: DeepSpeed then steps the Trainer's
    optimizer (the recipe's ``--optim sgd``, as the reference run) instead of AdamW."""
    with open(os.path.join(ROOT, "accelerate_configs", "ds_zero3.json")) as f:
        config = json.load(f)
    assert config["zero_optimization"]["stage"] == 3
    del config["optimizer"]
    config["zero_allow_untested_optimizer"] = True  # a torch optimizer on ZeRO's flat fp32 partitions
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.slow
def test_zero3_recipe_matches_one_process(tmp_path):
    require("deepspeed", "deepspeed")
    ds_config = _zero3_sgd_config(tmp_path / "zero3_sgd.json")
    reference = tmp_path / "reference"
    launch(1, [["finetune_long_docs.py", [*COMMON, "--tokens-per-rank", str(BUDGET), "--output-dir",
                                           str(reference)]]], tmp_path)  # fmt: skip
    # ZeRO-3 gathers each layer's parameters again for the recompute of gradient checkpointing, while
    # DistCA keeps the layer's attention output (rematerialization-aware)
    modes = {"serial": ["--no-ping-pong"],
             "ping_pong_checkpointing": ["--ping-pong", "--gradient-checkpointing"],
             "layer_ping_pong_checkpointing": ["--layer-ping-pong", "--gradient-checkpointing"]}  # fmt: skip
    launch(2, [
        ["finetune_long_docs.py", [*COMMON, "--tokens-per-rank", str(BUDGET // 2), "--deepspeed", ds_config, *flags,
                                   "--output-dir", str(tmp_path / name)]]
        for name, flags in modes.items()
    ], tmp_path)  # fmt: skip
    # 4 processes in 2 "nodes" of 2: layer-level ping-pong with KV across the nodes through the relay
    relay = {"layer_ping_pong_relay_4": ["--layer-ping-pong", "--gradient-checkpointing", "--ranks-per-node", "2",
                                         "--kv-relay"]}  # fmt: skip
    launch(4, [["finetune_long_docs.py", [*COMMON, "--tokens-per-rank", str(BUDGET // 4), "--deepspeed", ds_config,
                                          *flags, "--output-dir", str(tmp_path / name)]]
               for name, flags in relay.items()], tmp_path)  # fmt: skip
    ref_records, ref_weights, ref_summary = _results(reference)
    assert ref_summary["world_size"] == 1 and [r["step"] for r in ref_records] == [1, 2]
    runs = {name: _results(tmp_path / name) for name in [*modes, *relay]}
    for name, (records, weights, summary) in runs.items():
        # DeepSpeed trained (parameters partitioned over the ranks), not DDP
        world = 4 if name in relay else 2
        assert summary["world_size"] == world and summary["wrapped"] == "DeepSpeedEngine", (name, summary)
        assert [r["step"] for r in records] == [1, 2], name
        for got, want in zip(records, ref_records, strict=True):
            assert got["tokens"] == want["tokens"] == BUDGET * 2
            loss_tol = TOL["train_loss"][0] * abs(want["loss"])
            assert abs(got["loss"] - want["loss"]) <= loss_tol, (name, got, want)
            # documents cut over ranks: the engine communicated
            assert sum(got["bytes_sent"]) > 0, (name, got)
        assert weights.keys() == ref_weights.keys()
        for key, w in weights.items():
            torch.testing.assert_close(
                w, ref_weights[key], rtol=0, atol=TOL["train_weights"][1], msg=f"{name} {key}"
            )
    for serial, pp_ckpt, layers in zip(*(runs[name][0] for name in modes), strict=True):
        # serial: at most one server kernel per engine call
        assert all(k <= c for k, c in zip(serial["attn_fwd_kernels"], serial["engine_calls"])), serial
        # ping-pong ran (more server kernels than calls: calls that move rows are split) and the recompute
        # of checkpointing ran no attention (every call replayed its kept output instead)
        assert sum(pp_ckpt["attn_fwd_kernels"]) > sum(pp_ckpt["engine_calls"]), pp_ckpt
        assert pp_ckpt["attn_replays"] == pp_ckpt["engine_calls"], pp_ckpt
        # layer-level: one kernel per nano-batch and layer, each replayed by the recompute
        assert sum(layers["attn_fwd_kernels"]) > sum(serial["attn_fwd_kernels"]), (layers, serial)
        assert layers["attn_replays"] == layers["engine_calls"], layers
    # the relay forwarded: the stages that carry KV ran two all-to-alls each (4 a call without the relay)
    relayed = runs["layer_ping_pong_relay_4"][0]
    assert any(sum(r["exchanges"]) > 4 * sum(r["engine_calls"]) for r in relayed), relayed
    # the run learned something
    assert ref_records[-1]["loss"] < ref_records[0]["loss"]


# ------------------------------------------------ FSDP2 (torch's fully_shard) in a plain training loop
LOOP_TOKENS = 1024  # tokens per micro-batch over all ranks
LOOP_STEPS, LOOP_ACCUM = 2, 2


def _train_loop(
    rank: int,
    world: int,
    ping_pong: bool | str,
    shard: bool,
    relay: bool = False,
    offload: bool = False,
    memory: bool = False,
) -> dict:
    """The training loop of recipes/accelerate_loop.py (same global batches on any world size, loss
    token-weighted over the whole global batch) with the model sharded by FSDP2 when ``shard``.

    Returns the per-step losses, the full final weights (gathered from the shards) and the engine's
    counters of the run. ``ping_pong``: attention-level (True), off (False) or ``"layers"`` (layer-level:
    each micro-batch as two nano-batches whose forwards interleave, :func:`hf_distca.nano_batch_loss`);
    ``relay``: KV through the relay over nodes of 2 ranks (``DistCAConfig(kv_relay=True)``); ``offload``: the
    shards in host memory (FSDP2's ``CPUOffloadPolicy``, accelerate_configs/fsdp2_offload.yaml); ``memory``:
    rematerialization-aware checkpointing with every layer input offloaded, layer 0's attention output
    dropped and layer 1's kept in host memory, and the MLP in tiles of 16 tokens."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM, LlamaConfig

    import hf_distca
    from hf_distca import metrics
    from hf_distca.data import DistCABatches, DistCADataLoader, generate_documents

    documents = generate_documents(60, vocab_size=256, seed=3, mean_length=300, max_length=1000)
    batches = DistCABatches(documents, rank=rank, world_size=world, tokens_per_rank=LOOP_TOKENS // world,
                            grad_accum=LOOP_ACCUM, seed=3, max_steps=LOOP_STEPS,
                            nano_batches=2 if ping_pong == "layers" else 1)  # fmt: skip
    torch.manual_seed(3)  # the same initial weights on every rank and in the reference
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, attn_implementation="distca")
    hf_distca.enable_distca(
        model,
        group=dist.group.WORLD if world > 1 else None,
        config=hf_distca.DistCAConfig(
            shard_tokens=64, ping_pong=ping_pong is True, ranks_per_node=2 if relay else None, kv_relay=relay
        ),
    )
    if memory:
        hf_distca.enable_remat_checkpointing(model)
        hf_distca.tile_mlp(model, 16)
        options = hf_distca.OffloadOptions(inputs=True, kept_attention=("drop", "host"), min_bytes=0)
        memory_offload = hf_distca.offload_activations(model, options)
    if shard:  # one FSDP2 unit per decoder layer, the rest (embeddings, norm, head) in the root unit
        # pinned host memory needs an accelerator; on the CPU the policy still moves every shard's copy
        policy = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
        for layer in model.model.layers:
            fully_shard(layer, **policy)
        fully_shard(model, **policy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    metrics.reset()
    losses = []
    micro = iter(DistCADataLoader(batches))
    for _ in range(LOOP_STEPS):
        step_batches = [next(micro) for _ in range(LOOP_ACCUM)]
        total = torch.tensor(sum(int(b["shift_labels"].ne(-100).sum()) for b in step_batches))
        if world > 1:
            dist.all_reduce(total)
        step_loss = torch.zeros(())
        for i, batch in enumerate(step_batches):
            if shard:  # gradients accumulate unsharded; reduce-scattered once, after the last micro-batch
                model.set_requires_gradient_sync(i == LOOP_ACCUM - 1)
            loss = hf_distca.nano_batch_loss(model, batch, num_items_in_batch=int(total))
            # FSDP2 averages gradients over ranks; scale so the sum over ranks is the global mean
            (loss * world).backward()
            step_loss += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        if world > 1:
            dist.all_reduce(step_loss)
        losses.append(float(step_loss))
    stats = metrics.snapshot(reset=True)
    sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    layer_weights = hf_distca.engine.pricing.decoder_layer_weights(model)  # of the sharded model: full shapes
    weights = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }
    offloaded = memory_offload.report()["offloaded_tensors"] if memory else 0
    # the units whose shards FSDP2 keeps in host memory (its parameter groups' own flag)
    groups = [
        m._get_fsdp_state()._fsdp_param_group for m in model.modules() if shard and hasattr(m, "unshard")
    ]
    offloaded_units = sum(all(p.offload_to_cpu for p in g.fsdp_params) for g in groups if g is not None)
    return {"losses": losses, "weights": weights, "sharded": sharded, "bytes_sent": stats.bytes_sent,
            "offloaded_tensors": offloaded, "offloaded_units": offloaded_units,
            "attn_fwd_kernels": stats.attn_fwd_kernels, "layer_weights": layer_weights,
            "exchanges": stats.exchanges, "calls": stats.calls}  # fmt: skip


def _fsdp2_worker(rank: int, world: int) -> dict:
    return {pp: _train_loop(rank, world, ping_pong=pp, shard=True) for pp in (False, True, "layers")}


@pytest.mark.slow
def test_fsdp2_loop_matches_one_process():
    """DistCA attention in a model sharded by FSDP2 (fully_shard, 2 gloo processes, gradient accumulation,
    ping-pong off, attention-level and layer-level) trains the losses and final weights of the unsharded single-process run.

    The Trainer cannot run FSDP on the CPU (see the module docstring), so this is FSDP2 without Accelerate:
    the composition itself (parameters all-gathered around DistCA's exchanges, gradients reduce-scattered)."""
    from distributed import run_distributed

    reference = _train_loop(0, 1, ping_pong=False, shard=False)
    results = run_distributed(_fsdp2_worker, 2, timeout=600.0)
    assert len(reference["losses"]) == LOOP_STEPS and reference["losses"][-1] < reference["losses"][0]
    for rank, runs in enumerate(results):
        for pp, run in runs.items():
            # FSDP2 sharded every parameter; the layer's weights still count whole (layer_seconds_per_token)
            assert len(run["sharded"]) == len(run["weights"]), (rank, pp, run["sharded"])
            assert run["layer_weights"] == reference["layer_weights"] == 64 * (2 * 64 + 2 * 32) + 3 * 64 * 128
            for got, want in zip(run["losses"], reference["losses"], strict=True):
                loss_tol = TOL["train_loss"][0] * abs(want)
                assert abs(got - want) <= loss_tol, (rank, pp, run["losses"], reference["losses"])
            assert run["bytes_sent"] > 0, (rank, pp)  # documents cut over ranks: the engine communicated
            for name, w in run["weights"].items():
                want = reference["weights"][name]
                msg = f"rank {rank}, ping_pong={pp}: {name}"
                torch.testing.assert_close(w, want, rtol=0, atol=TOL["train_weights"][1], msg=msg)
        # ping-pong ran: two server kernels per layer (two parts, or one per nano-batch) where serial has one
        kernels = {pp: run["attn_fwd_kernels"] for pp, run in runs.items()}
        assert kernels[True] > kernels[False] and kernels["layers"] > kernels[False], (rank, kernels)


def assert_matches_reference(run: dict, reference: dict, label: str) -> None:
    """A training loop's losses and final weights (``run``) against the one-process ``reference``, within
    the train_loss and train_weights tolerances."""
    for got, want in zip(run["losses"], reference["losses"], strict=True):
        assert abs(got - want) <= TOL["train_loss"][0] * abs(want), (
            label,
            run["losses"],
            reference["losses"],
        )
    for name, w in run["weights"].items():
        want = reference["weights"][name]
        torch.testing.assert_close(w, want, rtol=0, atol=TOL["train_weights"][1], msg=f"{label}: {name}")


def _fsdp2_relay_worker(rank: int, world: int) -> dict:
    return _train_loop(rank, world, ping_pong="layers", shard=True, relay=True)


@pytest.mark.slow
def test_fsdp2_loop_through_the_relay_matches_one_process():
    """The same FSDP2 loop on 4 gloo processes in 2 "nodes" of 2, layer-level ping-pong, KV across the nodes
    through the relay (DistCAConfig(kv_relay=True)): the losses and final weights of the unsharded
    single-process run, and the relay ran (more all-to-alls than 4 per engine call)."""
    from distributed import run_distributed

    reference = _train_loop(0, 1, ping_pong=False, shard=False)
    for rank, run in enumerate(run_distributed(_fsdp2_relay_worker, 4, timeout=600.0)):
        assert_matches_reference(run, reference, f"rank {rank}")
        assert run["exchanges"] > 4 * run["calls"], (rank, run["exchanges"], run["calls"])


def _recipe():
    sys.path.insert(0, RECIPES)
    import finetune_long_docs

    return finetune_long_docs


def test_recipe_refuses_fsdp_on_cpu(tmp_path, monkeypatch):
    """On the CPU Accelerate would train DDP for an FSDP request (TrainingArguments' fsdp or an accelerate
    launch FSDP config, which reaches the processes as ACCELERATE_USE_FSDP): a clear error instead."""
    from transformers import TrainingArguments

    recipe = _recipe()
    args = recipe.parse_args(["--output-dir", str(tmp_path)])
    plain = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    recipe.check_parallelism(args, plain)  # DDP on the CPU: fine
    fsdp2 = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], fsdp="full_shard",
                              fsdp_config={"version": 2})  # fmt: skip
    with pytest.raises(ValueError, match="FSDP needs GPUs"):
        recipe.check_parallelism(args, fsdp2)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="FSDP needs GPUs"):
        recipe.check_parallelism(args, plain)


def test_recipe_refuses_optim_that_deepspeed_would_ignore(tmp_path):
    """accelerate_configs/ds_zero3.json names its own optimizer (AdamW): with it, --optim sgd would silently
    train AdamW (at SGD's learning rate); without an optimizer section --optim is honoured."""
    require("deepspeed", "deepspeed")
    from transformers import TrainingArguments
    from transformers.integrations import unset_hf_deepspeed_config

    recipe = _recipe()
    repo_config = os.path.join(ROOT, "accelerate_configs", "ds_zero3.json")
    try:
        offload_config = os.path.join(ROOT, "accelerate_configs", "ds_zero3_offload.json")
        for config, optim, refused in ((repo_config, "sgd", True), (repo_config, None, False),
                                       (_zero3_sgd_config(tmp_path / "sgd.json"), "sgd", False),
                                       (offload_config, "sgd", True), (offload_config, None, False)):  # fmt: skip
            optim_argv = ["--optim", optim] if optim else []
            argv = ["--output-dir", str(tmp_path), "--deepspeed", config, *optim_argv]
            args = recipe.parse_args(argv)
            training_args = TrainingArguments(**recipe.training_kwargs(args))
            if refused:
                with pytest.raises(ValueError, match="--optim sgd would be ignored"):
                    recipe.check_parallelism(args, training_args)
            else:
                recipe.check_parallelism(args, training_args)
    finally:
        unset_hf_deepspeed_config()  # the DeepSpeed config must not leak into later tests of this process
