"""--liger (liger-kernel's fused linear cross-entropy) keeps DistCA's loss normalisation exact.

liger-kernel's kernels are Triton (GPU only), so on the CPU its fused linear cross-entropy function is
replaced by a plain PyTorch one with the same signature; everything around it runs as on the GPU:
``Trainer(use_liger_kernel=True)`` patches the model's forward with liger's ``lce_forward``, which must
score DistCA's pre-shifted ``shift_labels`` as given and divide by the Trainer's
``num_items_in_batch`` (the whole step's targets). The kernel itself is compared on the GPU
(benchmarks/suite.py runs the recipe with --liger).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from extras import require
from test_callback import dataset, read_records, tiny_llama, trainer_args
from tolerances import TOL

import hf_distca

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
liger_functional = require("liger_kernel.transformers.functional", "liger")


def load_recipe():
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    import finetune_long_docs

    return finetune_long_docs


def test_liger_loss_uses_shift_labels_and_num_items_in_batch(tmp_path, monkeypatch):
    calls = []

    def fused_linear_cross_entropy(
        input, weight, target, bias=None, ce_weight=None, ignore_index=-100, lse_square_scale=0.0,
        label_smoothing=0.0, reduction="mean", softcap=None, return_z_loss=False, accum_dtype=None,
        use_token_scaling=False, return_token_accuracy=False, return_predicted_tokens=False, chunk_mem_const=1,
    ):  # fmt: skip
        calls.append((reduction, int((target != ignore_index).sum())))
        logits = (input @ weight.T).float()  # (T, V)
        return torch.nn.functional.cross_entropy(
            logits, target, ignore_index=ignore_index, reduction=reduction
        )

    def run(out, **liger):
        cb = hf_distca.DistCACallback(tokens_per_rank=512, config=hf_distca.DistCAConfig(shard_tokens=32))
        model = tiny_llama()
        trainer = hf_distca.DistCATrainer(
            model=model, args=trainer_args(out, max_steps=3, gradient_accumulation_steps=2, **liger),
            train_dataset=dataset(), callbacks=[cb],
        )  # fmt: skip
        trainer.train()
        return model, read_records(out / "metrics.jsonl")

    _, plain = run(tmp_path / "plain")
    monkeypatch.setattr(liger_functional, "liger_fused_linear_cross_entropy", fused_linear_cross_entropy)
    model, fused = run(
        tmp_path / "liger", use_liger_kernel=True, liger_kernel_config=load_recipe().LIGER_CONFIG
    )
    from liger_kernel.transformers.model.llama import lce_forward

    assert model.forward.__func__ is lce_forward  # the Trainer applied liger's forward to the model
    # every micro-batch went through the fused loss, summed and divided by the step's target count
    assert len(calls) == 6 and all(reduction == "sum" for reduction, _ in calls)
    for got, want in zip(fused, plain, strict=True):
        assert abs(got["loss"] - want["loss"]) <= TOL["train_loss"][0] * abs(want["loss"]), (got, want)
    assert plain[-1]["loss"] < plain[0]["loss"]


def test_liger_flag_refused_on_the_cpu(tmp_path):
    with pytest.raises(ValueError, match="--liger needs a CUDA GPU"):
        load_recipe().main(["--liger", "--cpu", "--output-dir", str(tmp_path)])
