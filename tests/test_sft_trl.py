"""recipes/sft_trl.py (TRL's SFTTrainer + DistCACallback) and the baseline layouts, through the recipes.

One launch of 2 CPU processes (gloo, fp32) runs, on the same generated documents: the Trainer recipe,
the SFTTrainer recipe, the balanced-packing baseline (exact: DistCA's engine with balancing off) and
the HF-default baseline (attention local to each piece).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from extras import require
from run_recipes import baseline_args, launch
from tolerances import TOL

from hf_distca.data import DistCABatches
from hf_distca.data.baselines import LAYOUTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# documents up to 1500 tokens on 2 x 512 tokens per micro-batch: many are cut over the two ranks
COMMON = [
    "--num-documents", "60", "--max-steps", "3", "--grad-accum", "2", "--tokens-per-rank", "512",
    "--optim", "sgd", "--learning-rate", "0.5", "--shard-tokens", "64", "--seed", "4", "--no-save",
]  # fmt: skip


def load_recipe():
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    import finetune_long_docs

    return finetune_long_docs


def records(path) -> list[dict]:
    with open(os.path.join(path, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_sft_trainer_and_baselines_match_the_trainer_recipe_on_two_ranks(tmp_path):
    require("trl", "trl")
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([40, 300, 700, 900, 1500, 90]))
    data = ["--doc-lengths", str(lengths), *COMMON]
    runs = {
        "trainer": ["finetune_long_docs.py", []],
        "sft": ["sft_trl.py", []],
        # padded to the budget: there the token-only layout places these documents unlike the balanced one
        "tokens": [
            "finetune_long_docs.py",
            ["--layout", "tokens", "--max-planner-moves", "0", "--pad-to-budget"],
        ],
        "hf_default": ["finetune_long_docs.py", ["--layout", "hf-default"]],
    }
    spec = [
        [recipe, [*data, *extra, "--output-dir", str(tmp_path / name)]]
        for name, (recipe, extra) in runs.items()
    ]
    spec[-1][1] = baseline_args(spec[-1][1], "local")
    launch(2, spec, tmp_path)
    got = {name: records(tmp_path / name) for name in runs}
    ref = got["trainer"]
    assert [r["step"] for r in ref] == [1, 2, 3]
    # DistCA really moved work: documents were cut over the ranks and their KV crossed
    assert all(sum(r["bytes_sent"]) > 0 for r in ref)
    assert ref[-1]["loss"] < ref[0]["loss"]
    # SFTTrainer: the same batches and the same token-weighted loss (TRL's fused LM head on shift_labels)
    # the token-only layout: other ranks hold the tokens, DistCA's engine (balancing off) keeps the math exact
    for name in ("sft", "tokens"):
        assert [r["step"] for r in got[name]] == [1, 2, 3]
        for mine, want in zip(got[name], ref, strict=True):
            assert mine["tokens"] == want["tokens"] == 2048
            rel = abs(mine["loss"] - want["loss"]) / abs(want["loss"])
            assert rel <= TOL["train_loss"][0], (name, mine, want)
    assert got["sft"][0]["attn_flops_before"] == ref[0]["attn_flops_before"]  # the same layout
    # the token-only layout moved no attention (no planner moves)
    for r in got["tokens"]:
        assert r["attn_flops_after"] == r["attn_flops_before"]
    # each run laid its batches out with its layout: the recorded load is that layout's, step by step
    recipe = load_recipe()
    documents, _ = recipe.documents_from_lengths(recipe.parse_args(data))
    flops_per_pair = 4 * 4 * 32 * 2  # tiny-llama: 4 heads x head_dim 32 x 2 layers

    def load(layout: str, pad_to_budget: bool) -> list[list[int]]:
        batches = DistCABatches(documents, rank=0, world_size=2, tokens_per_rank=512, grad_accum=2, seed=4,
                                layout=LAYOUTS[layout], pad_to_budget=pad_to_budget)  # fmt: skip
        return [[p * flops_per_pair for p in batches.layout_load(step)] for step in range(3)]

    for name, layout, pad in (
        ("trainer", "distca", False),
        ("tokens", "tokens", True),
        ("hf_default", "hf-default", False),
    ):
        assert [r["attn_flops_before"] for r in got[name]] == load(layout, pad), name
    # the check tells the layouts apart: padded, the balanced layout's loads differ from the token-only one's
    assert load("distca", True) != load("tokens", True)
    # HF default: nothing crosses ranks; chunks of documents cut over ranks lose their context (the
    # math differs: the loss is close to the exact one, not equal by construction)
    hf = got["hf_default"]
    assert all(sum(r["bytes_sent"]) == 0 for r in hf)
    assert all(abs(a["loss"] - b["loss"]) < 0.05 * b["loss"] for a, b in zip(hf, ref, strict=True))
    assert hf[0]["imbalance_before"] > ref[0]["imbalance_before"]
    summary = json.loads((tmp_path / "sft" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["peak_memory_gib"] is None  # CPU: no GPU memory


def test_sft_config_must_leave_the_batches_to_distca(tmp_path):
    require("trl", "trl")
    import datasets
    from test_callback import tiny_llama
    from trl import SFTConfig

    import hf_distca
    from hf_distca.sft import DistCASFTTrainer

    load_recipe()
    from sft_trl import token_id_tokenizer

    docs = datasets.Dataset.from_list([{"input_ids": list(range(1, 200))}] * 8)
    base = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], **{load_recipe()._CHECKPOINTING_ARG: False},
                max_steps=1, padding_free=False, packing=False, dataset_kwargs={"skip_prepare_dataset": True})  # fmt: skip
    for change, named in (
        ({"packing": True}, "packing=True"),
        ({"dataset_kwargs": None}, "dataset_kwargs=None"),
        ({"completion_only_loss": True}, "completion_only_loss=True"),
        ({"label_smoothing_factor": 0.1}, "label_smoothing_factor=0.1"),
    ):
        with pytest.raises(ValueError, match=f"{named}.*would change DistCA's batches"):
            DistCASFTTrainer(
                model=tiny_llama(), args=SFTConfig(**{**base, **change}), train_dataset=docs,
                processing_class=token_id_tokenizer(128),
                callbacks=[hf_distca.DistCACallback(tokens_per_rank=512)],
            )  # fmt: skip
    with pytest.raises(ValueError, match="needs args=SFTConfig"):
        DistCASFTTrainer(model=tiny_llama(), args=None, train_dataset=docs)
    trainer = DistCASFTTrainer(
        model=tiny_llama(),
        args=SFTConfig(**base),
        train_dataset=docs,
        processing_class=token_id_tokenizer(128),
    )
    with pytest.raises(ValueError, match="DistCASFTTrainer needs exactly one DistCACallback"):
        trainer.train()
    with pytest.raises(
        ValueError, match="--liger: SFTTrainer computes the loss with TRL's own fused LM head"
    ):
        __import__("sft_trl").main(["--liger", "--output-dir", str(tmp_path / "run")])
