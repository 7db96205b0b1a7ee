"""Built-in random-init models get the same weights under DeepSpeed ZeRO-3 as under DDP (CPU, gloo).

Under ZeRO-3 Transformers builds models inside ``deepspeed.zero.Init`` and initialises them on rank 0
afterwards, drawing the random numbers in another order: the same seed then gives other weights. The
recipe builds its random-init models whole (``built_whole``); this checks, on 2 processes with the
repository's own ``accelerate_configs/ds_zero3.json``, that the weights equal the plain build bit for
bit, and that the zero.Init build (what the recipe did before) does not, so the check can fail.
"""

from __future__ import annotations

import os
import tempfile

import torch
from distributed import run_distributed, skip_deepspeed_shm_build
from extras import require

require("deepspeed", "deepspeed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_recipe():
    import importlib.util

    path = os.path.join(ROOT, "recipes", "finetune_long_docs.py")
    spec = importlib.util.spec_from_file_location("finetune_long_docs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _state(model) -> dict[str, torch.Tensor]:
    """Full parameters and buffers, gathered when ZeRO-3 partitioned them."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {name: t.detach().clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}


def _worker(rank: int, world: int) -> dict:
    import deepspeed
    from transformers import TrainingArguments
    from transformers.integrations import is_deepspeed_zero3_enabled

    os.environ["LOCAL_RANK"] = str(rank)  # deepspeed.zero.Init reads it (torchrun sets it)
    skip_deepspeed_shm_build()
    deepspeed.init_distributed(dist_backend="gloo")  # on GPUs TrainingArguments does it (NCCL)
    recipe = _load_recipe()
    args = recipe.parse_args(
        ["--model", "tiny-llama", "--num-layers", "2", "--seed", "5", "--cpu", "--attn", "sdpa"]
    )
    plain = _state(recipe.build_model(args, 300, torch.float32))  # DDP / FSDP: no DeepSpeed config
    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out,
            use_cpu=True,
            report_to=[],
            deepspeed=os.path.join(ROOT, "accelerate_configs", "ds_zero3.json"),
        )
        assert is_deepspeed_zero3_enabled()
        whole = _state(recipe.build_model(args, 300, torch.float32, training_args))
        assert is_deepspeed_zero3_enabled()  # the DeepSpeed config is active again for the Trainer
        under_zero_init = recipe.build_model(args, 300, torch.float32)  # no training_args: zero.Init
        partitioned = [n for n, p in under_zero_init.named_parameters() if p.numel() == 0]
        zero_init = _state(under_zero_init)
    return {"plain": plain, "whole": whole, "zero_init": zero_init, "partitioned": partitioned}


def test_builtin_model_weights_equal_under_ddp_and_zero3():
    results = run_distributed(_worker, 2, timeout=600.0)
    for rank, res in enumerate(results):
        assert res["plain"].keys() == res["whole"].keys() == res["zero_init"].keys()
        assert len(res["partitioned"]) > 0, "zero.Init did not partition the model: the check is vacuous"
        for name, want in res["plain"].items():
            torch.testing.assert_close(res["whole"][name], want, rtol=0, atol=0, msg=f"rank {rank} {name}")
            torch.testing.assert_close(results[0]["plain"][name], want, rtol=0, atol=0)  # same on every rank
        differ = [n for n, t in res["zero_init"].items() if not torch.equal(t, res["plain"][n])]
        assert any(".weight" in n for n in differ), "zero.Init gave the plain weights: nothing to fix?"
