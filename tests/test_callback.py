"""DistCACallback and the pre-flight checks, in one process (no launcher)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, Trainer, TrainingArguments

import hf_distca
from hf_distca.data.synthetic import generate_documents
from hf_distca.kernels import UnsupportedFeatureError
from hf_distca.validation import check_launch, check_model_supported


def tiny_llama(attn: str = "distca", **overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, **overrides,
    )  # fmt: skip
    return LlamaForCausalLM._from_config(cfg, attn_implementation=attn)


def trainer_args(tmp_path, **kw) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(tmp_path), max_steps=kw.pop("max_steps", 2), per_device_train_batch_size=1,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        disable_tqdm=True, **kw,
    )  # fmt: skip


def dataset(n: int = 40):
    return [
        {"input_ids": ids}
        for ids in generate_documents(n, vocab_size=128, seed=1, mean_length=150, max_length=700)
    ]


def test_trainer_run_writes_metrics_and_plot(tmp_path):
    cb = hf_distca.DistCACallback(tokens_per_rank=512, config=hf_distca.DistCAConfig(shard_tokens=32))
    trainer = Trainer(
        model=tiny_llama(), args=trainer_args(tmp_path, max_steps=3), train_dataset=dataset(), callbacks=[cb]
    )
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    keys = {"step", "loss", "tokens", "step_time_s", "attn_flops_before", "attn_flops_after", "imbalance_before",
            "imbalance_after", "bytes_sent"}  # fmt: skip
    for r in records:
        assert keys <= r.keys()
        assert r["tokens"] == 512
        assert r["loss"] is not None and 0 < r["loss"] < 10
        assert len(r["attn_flops_after"]) == 1 and r["attn_flops_after"][0] > 0
        assert r["bytes_sent"] == [0]  # one process: nothing to send
        assert r["engine_calls"] == 2  # one micro-batch x 2 layers
    assert os.path.getsize(tmp_path / "attention_load.png") > 1000
    assert cb.summary["steps"] == 3


def test_callback_outside_trainer_is_refused(tmp_path):
    cb = hf_distca.DistCACallback(tokens_per_rank=512)
    with pytest.raises(RuntimeError, match="must be given to a transformers Trainer"):
        cb.on_init_end(trainer_args(tmp_path), None, None, model=tiny_llama())


def test_tokens_per_rank_below_one_shard():
    with pytest.raises(ValueError, match="smaller than one 128-token shard"):
        hf_distca.DistCACallback(tokens_per_rank=100)


def test_dataset_without_input_ids(tmp_path):
    cb = hf_distca.DistCACallback(tokens_per_rank=512)
    with pytest.raises(ValueError, match="no 'input_ids' column"):
        Trainer(
            model=tiny_llama(), args=trainer_args(tmp_path), train_dataset=[{"text": "hi"}], callbacks=[cb]
        )


def test_model_not_using_distca(tmp_path):
    cb = hf_distca.DistCACallback(tokens_per_rank=512)
    with pytest.raises(ValueError, match="attn_implementation='distca'"):
        Trainer(
            model=tiny_llama("sdpa"), args=trainer_args(tmp_path), train_dataset=dataset(), callbacks=[cb]
        )


def test_unsupported_models_refused_before_training():
    mistral = MistralConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=64, sliding_window=256)  # fmt: skip
    model = type("M", (), {"config": mistral})()
    mistral._attn_implementation = "distca"
    with pytest.raises(UnsupportedFeatureError, match="sliding_window=256"):
        check_model_supported(model, max_document_tokens=4096)
    check_model_supported(model, max_document_tokens=256)  # every document fits in the window: exact
    for key, value, match in (
        ("is_encoder_decoder", True, "cross-attention"),
        ("is_causal", False, "non-causal"),
        ("attn_logit_softcapping", 30.0, "softcapping"),
        ("attention_dropout", 0.1, "attention_dropout"),
    ):
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
        cfg._attn_implementation = "distca"
        setattr(cfg, key, value)
        with pytest.raises(UnsupportedFeatureError, match=match):
            check_model_supported(type("M", (), {"config": cfg})(), max_document_tokens=1024)


def test_world_size_mismatch(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = type("A", (), {"world_size": 1, "process_index": 0})()
    with pytest.raises(RuntimeError, match="use_cpu=True"):
        check_launch(args)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert check_launch(args) == 1
