"""DistCACallback and the pre-flight checks, in one process (no launcher)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from tolerances import TOL
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import hf_distca
from hf_distca.data import DistCABatches, layout_balanced, layout_micro_batch, layout_pieces
from hf_distca.data.synthetic import generate_documents
from hf_distca.kernels import UnsupportedFeatureError
from hf_distca.planning import plan_core_attention
from hf_distca.validation import check_launch, check_model_supported


def tiny_llama(attn: str = "distca", **overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, **overrides,
    )  # fmt: skip
    return LlamaForCausalLM._from_config(cfg, attn_implementation=attn)


def trainer_args(tmp_path, **kw) -> TrainingArguments:
    kw = {"max_steps": 2, "logging_steps": 1, "save_strategy": "no", **kw}
    return TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=1, learning_rate=1e-3, report_to=[],
        use_cpu=True, disable_tqdm=True, **kw,
    )  # fmt: skip


def dataset(n: int = 40):
    return [
        {"input_ids": ids}
        for ids in generate_documents(n, vocab_size=128, seed=1, mean_length=150, max_length=700)
    ]


def distca_trainer(tmp_path, callback=None, model=None, **kw) -> hf_distca.DistCATrainer:
    callback = callback or hf_distca.DistCACallback(
        tokens_per_rank=512, config=hf_distca.DistCAConfig(shard_tokens=32)
    )
    return hf_distca.DistCATrainer(
        model=model or tiny_llama(),
        args=trainer_args(tmp_path, **kw),
        train_dataset=dataset(),
        callbacks=[callback],
    )


def read_records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_trainer_run_writes_metrics_and_plot(tmp_path):
    trainer = distca_trainer(tmp_path, max_steps=3)
    trainer.train()
    cb = trainer.distca_callback
    records = read_records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    keys = {"step", "loss", "tokens", "step_time_s", "attn_flops_before", "attn_flops_after", "imbalance_before",
            "imbalance_after", "imbalance_token_layout", "bytes_sent", "bytes_received", "engine_calls", "plans",
            "plan_seconds"}  # fmt: skip
    logged = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    for r in records:
        assert keys <= r.keys()
        assert r["tokens"] == 512
        assert r["loss"] is not None and 0 < r["loss"] < 10
        # logging_steps=1: the Trainer's own loss of the step is the record's
        assert r["loss"] == pytest.approx(logged[r["step"]]["loss"], rel=TOL["train_loss"][0])
        assert len(r["attn_flops_after"]) == 1 and r["attn_flops_after"][0] > 0
        assert r["bytes_sent"] == [0]  # one process: nothing to send
        assert r["engine_calls"] == [2]  # one micro-batch x 2 layers
        assert all(
            type(x) is int for k in ("bytes_sent", "bytes_received", "engine_calls", "plans") for x in r[k]
        )
    assert os.path.getsize(tmp_path / "attention_load.png") > 1000
    assert cb.summary["steps"] == 3


def test_callback_in_plain_trainer_is_refused(tmp_path):
    cb = hf_distca.DistCACallback(tokens_per_rank=512)
    with pytest.raises(RuntimeError, match="DistCACallback needs hf_distca.DistCATrainer"):
        Trainer(model=tiny_llama(), args=trainer_args(tmp_path), train_dataset=dataset(), callbacks=[cb])


def test_add_callback(tmp_path):
    """After construction: a plain Trainer refuses before any forward runs; DistCATrainer works."""
    model = tiny_llama()
    forwards = []
    model.register_forward_pre_hook(lambda *a: forwards.append(1))
    plain = Trainer(model=model, args=trainer_args(tmp_path), train_dataset=dataset())
    plain.add_callback(hf_distca.DistCACallback(tokens_per_rank=512))
    with pytest.raises(RuntimeError, match="DistCACallback needs hf_distca.DistCATrainer"):
        plain.train()
    assert forwards == [] and plain.state.global_step == 0

    trainer = hf_distca.DistCATrainer(
        model=tiny_llama(), args=trainer_args(tmp_path), train_dataset=dataset()
    )
    with pytest.raises(ValueError, match="needs exactly one DistCACallback"):
        trainer.train()
    with pytest.raises(ValueError, match="instance"):
        trainer.add_callback(hf_distca.DistCACallback)
    cb = hf_distca.DistCACallback(tokens_per_rank=512, config=hf_distca.DistCAConfig(shard_tokens=32))
    trainer.add_callback(cb)
    with pytest.raises(ValueError, match="already has a DistCACallback"):
        trainer.add_callback(hf_distca.DistCACallback(tokens_per_rank=512))
    trainer.train()
    assert [r["step"] for r in read_records(tmp_path / "metrics.jsonl")] == [1, 2]
    with pytest.raises(ValueError, match="no 'input_ids' column"):  # checked by add_callback, at once
        hf_distca.DistCATrainer(
            model=tiny_llama(), args=trainer_args(tmp_path), train_dataset=[{"text": "hi"}]
        ).add_callback(hf_distca.DistCACallback(tokens_per_rank=512))


class LogSpy(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def test_one_record_per_step_and_figures_in_trainer_logs(tmp_path):
    trainer = distca_trainer(tmp_path, max_steps=6, logging_steps=3, gradient_accumulation_steps=2)
    spy = LogSpy()  # report_to integrations are callbacks that run before the user's: go first
    trainer.callback_handler.callbacks.insert(0, spy)
    trainer.train()
    records = read_records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert all(
        r["tokens"] == 1024 and r["engine_calls"] == [4] for r in records
    )  # 2 micro-batches x 2 layers
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logged] == [3, 6]
    spied = [entry for entry in spy.logs if "loss" in entry]
    for h, seen, window in zip(logged, spied, (records[:3], records[3:]), strict=True):

        def mean(key, window=window):
            return sum(r[key] for r in window) / 3

        assert h["loss"] == pytest.approx(mean("loss"), rel=TOL["train_loss"][0])
        for key in ("imbalance_before", "imbalance_after", "step_time_s", "tokens"):
            assert h[f"distca/{key}"] == pytest.approx(mean(key), rel=1e-12)
        assert h["distca/attn_flops_after_max"] == pytest.approx(
            sum(max(r["attn_flops_after"]) for r in window) / 3, rel=1e-12
        )
        assert h["distca/bytes_sent_max"] == 0
        assert {k: v for k, v in seen.items() if k.startswith("distca/")} == {
            k: v for k, v in h.items() if k.startswith("distca/")
        }


def test_resume_gives_the_uninterrupted_batches_and_losses(tmp_path):
    """Checkpoint at step 3 of 6 (the loader's epochs are 2 steps: the resume lands mid-epoch 1, after
    a data epoch of 3 steps began), resume in the same output_dir: same batches, same losses, and the
    metrics file holds steps 1-6 once each."""

    def run(resume=None):
        model = tiny_llama()
        seen = []
        model.register_forward_pre_hook(
            lambda m, a, kw: seen.append(kw["input_ids"].clone()), with_kwargs=True
        )
        trainer = hf_distca.DistCATrainer(
            model=model,
            args=trainer_args(
                tmp_path, max_steps=6, gradient_accumulation_steps=2, save_strategy="steps", save_steps=3
            ),  # fmt: skip
            train_dataset=dataset(20),
            callbacks=[
                hf_distca.DistCACallback(tokens_per_rank=512, config=hf_distca.DistCAConfig(shard_tokens=32))
            ],
        )
        assert trainer.distca_callback.batches.steps_per_epoch == 2
        trainer.train(resume_from_checkpoint=resume)
        return seen, trainer.distca_callback.records

    full_batches, full_records = run()
    assert [r["step"] for r in full_records] == [1, 2, 3, 4, 5, 6]
    resumed_batches, resumed_records = run(resume=str(tmp_path / "checkpoint-3"))
    assert [r["step"] for r in resumed_records] == [4, 5, 6]
    assert len(resumed_batches) == 6 and len(full_batches) == 12  # 2 micro-batches per step
    for got, want in zip(resumed_batches, full_batches[6:], strict=True):
        assert torch.equal(got, want)
    for got, want in zip(resumed_records, full_records[3:], strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=TOL["train_loss"][0])
        assert got["attn_flops_before"] == want["attn_flops_before"]
    in_file = read_records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in in_file] == [1, 2, 3, 4, 5, 6]
    assert in_file[:3] == full_records[:3] and in_file[3:] == resumed_records


def test_layout_load_is_the_planner_load_before_in_every_mode():
    """The attention load without balancing (the records' attn_flops_before, whatever the attention
    mode): every rank's pieces with their full context, exactly the planner's load_before."""
    docs = generate_documents(60, vocab_size=128, seed=2, mean_length=300, max_length=1500)
    cut = differs = 0
    for disaggregate in (True, False):
        batches = DistCABatches(docs, rank=0, world_size=3, tokens_per_rank=256, grad_accum=2, seed=5,
                                disaggregate=disaggregate)  # fmt: skip
        yielded = iter(batches)
        for step in range(batches.steps_per_epoch):
            load, token_load = [0.0] * 3, [0.0] * 3
            for doc_indices in batches.step(step):
                batch = next(yielded)
                assert batches.current_step == step
                # laid out at the fewest tokens per rank that hold it (pad_to_budget=False, the default)
                tokens = -(-sum(len(docs[i][:768]) for i in doc_indices) // 3)
                all_pieces = layout_micro_batch(
                    [docs[i][:768] for i in doc_indices], world_size=3, tokens_per_rank=tokens
                )[0].all_pieces
                if disaggregate:
                    assert batch["distca_layout"].all_pieces == all_pieces
                plan = plan_core_attention(all_pieces, q_row_bytes=1, kv_row_bytes=1)
                load = [a + b for a, b in zip(load, plan.load_before)]
                cut += sum(p.doc_start > 0 for pieces in all_pieces for p in pieces)
                token_pieces = layout_pieces(
                    [len(docs[i][:768]) for i in doc_indices], world_size=3, tokens_per_rank=tokens
                )
                token_plan = plan_core_attention(token_pieces, q_row_bytes=1, kv_row_bytes=1)
                token_load = [a + b for a, b in zip(token_load, token_plan.load_before)]
            assert batches.layout_load(step) == load
            assert batches.layout_load(step, layout=layout_pieces) == token_load
            differs += token_load != load
    assert cut > 0  # documents were cut over ranks: pieces that start mid-document carry context
    assert differs > 0  # the two layouts place some step's documents differently


def test_layout_load_reads_the_layouts_the_loader_made():
    """Once a step's micro-batches are yielded, its default load comes from their layouts: the layout
    runs once per micro-batch, not again for the metrics (another layout is still computed)."""
    docs = generate_documents(40, vocab_size=128, seed=3, mean_length=300, max_length=1500)
    calls = []

    def counted(lengths, **kw):
        calls.append(len(lengths))
        return layout_balanced(lengths, **kw)

    batches = DistCABatches(
        docs, rank=0, world_size=3, tokens_per_rank=256, grad_accum=2, seed=5, layout=counted
    )
    fresh = DistCABatches(docs, rank=0, world_size=3, tokens_per_rank=256, grad_accum=2, seed=5)
    yielded = iter(batches)
    for _ in batches.step(0):
        next(yielded)
    made = len(calls)
    assert made == len(batches.step(0)) == 2
    assert batches.layout_load(0) == fresh.layout_load(0) and len(calls) == made
    assert batches.layout_load(0, layout=layout_pieces) == fresh.layout_load(0, layout=layout_pieces)
    assert len(calls) == made  # the other layout ran, not this one
    assert batches.layout_load(1) == fresh.layout_load(1) and len(calls) == made + 2  # not yielded yet


def test_tokens_per_rank_below_one_shard():
    with pytest.raises(ValueError, match="smaller than one 128-token shard"):
        hf_distca.DistCACallback(tokens_per_rank=100)


def test_dataset_without_input_ids(tmp_path):
    cb = hf_distca.DistCACallback(tokens_per_rank=512)
    with pytest.raises(ValueError, match="no 'input_ids' column"):
        hf_distca.DistCATrainer(
            model=tiny_llama(), args=trainer_args(tmp_path), train_dataset=[{"text": "hi"}], callbacks=[cb]
        )


def test_model_not_using_distca(tmp_path):
    cb = hf_distca.DistCACallback(tokens_per_rank=512)
    with pytest.raises(ValueError, match="attn_implementation='distca'"):
        hf_distca.DistCATrainer(
            model=tiny_llama("sdpa"), args=trainer_args(tmp_path), train_dataset=dataset(), callbacks=[cb]
        )


def test_unsupported_models_refused_before_training():
    mistral = MistralConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=64, sliding_window=256)  # fmt: skip
    model = type("M", (), {"config": mistral})()
    mistral._attn_implementation = "distca"
    check_model_supported(model)  # windows shorter than documents are exact
    for key, value in (
        ("attn_logit_softcapping", 30.0),
        ("model_type", "gpt_oss"),
    ):  # Gemma 2, gpt-oss: exact
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
        cfg._attn_implementation = "distca"
        setattr(cfg, key, value)
        check_model_supported(type("M", (), {"config": cfg})())
    for key, value, match in (
        ("is_encoder_decoder", True, "cross-attention"),
        ("is_causal", False, "non-causal"),
        ("attention_dropout", 0.1, "attention_dropout"),
    ):
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
        cfg._attn_implementation = "distca"
        setattr(cfg, key, value)
        with pytest.raises(UnsupportedFeatureError, match=match):
            check_model_supported(type("M", (), {"config": cfg})())


def test_world_size_mismatch(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = type("A", (), {"world_size": 1, "process_index": 0})()
    with pytest.raises(RuntimeError, match="use_cpu=True"):
        check_launch(args)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert check_launch(args) == 1
