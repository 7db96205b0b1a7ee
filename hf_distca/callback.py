"""DistCACallback: DistCA for the Hugging Face Trainer, as one callback.

It owns the data path (global token-budget batches rebatched over the ranks), the attention-server
group (the data-parallel world), pre-flight checks and per-step metrics (``metrics.jsonl`` and a PNG
of per-rank attention load). The Trainer exposes no public hook to change its training dataloader
from a callback, so at ``on_init_end`` the callback finds the Trainer that is calling it and overrides
``get_train_dataloader`` on that instance (the method Transformers documents as the one to override).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import time

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from hf_distca import metrics
from hf_distca.attention import enable_distca
from hf_distca.checkpointing import switch_trainer_checkpointing
from hf_distca.config import DistCAConfig
from hf_distca.data.loader import DistCABatches, DistCADataLoader, TokenDocuments
from hf_distca.validation import check_launch, check_model_supported


class DistCACallback(TrainerCallback):
    """Balance core attention across data-parallel ranks during ``Trainer.train()``.

    Args:
        tokens_per_rank: tokens every rank holds per micro-batch (the global micro-batch is
            ``tokens_per_rank x world_size`` tokens; documents longer than one rank's share are cut
            into pieces over several ranks and still trained whole).
        config: engine configuration (tolerance, shard size, kernel backend).
        seed: seed of the document order (default: ``TrainingArguments.seed``).
        metrics_file: JSON-lines file (relative to ``output_dir``) with one record per optimizer step.
        plot_file: PNG (relative to ``output_dir``) of per-rank attention load before/after, or None.
        disaggregate: False keeps the same data path but attention stays local to each rank (the
            baseline for comparisons; documents cut over ranks lose cross-rank context).
        column: the dataset column holding each document's token ids.
        pad_token_id: id of padding tokens (default: the model config's, else 0).
        recompute_attention: with activation checkpointing on, recompute core attention in backward as
            plain checkpointing does (for comparison). Default False: rematerialization-aware
            checkpointing keeps each layer's attention output and log-sum-exp instead
            (:mod:`hf_distca.checkpointing`).
    """

    def __init__(
        self,
        tokens_per_rank: int,
        *,
        config: DistCAConfig | None = None,
        seed: int | None = None,
        metrics_file: str | None = "metrics.jsonl",
        plot_file: str | None = "attention_load.png",
        disaggregate: bool = True,
        column: str = "input_ids",
        pad_token_id: int | None = None,
        recompute_attention: bool = False,
    ):
        self.config = config or DistCAConfig()
        if not isinstance(tokens_per_rank, int) or tokens_per_rank < self.config.shard_tokens:
            raise ValueError(
                f"tokens_per_rank={tokens_per_rank!r} is smaller than one {self.config.shard_tokens}-token shard; "
                f"use at least {self.config.shard_tokens} (typical: 8192-65536)"
            )
        self.tokens_per_rank = tokens_per_rank
        self.seed = seed
        self.metrics_file = metrics_file
        self.plot_file = plot_file
        self.disaggregate = disaggregate
        self.column = column
        self.pad_token_id = pad_token_id
        self.recompute_attention = recompute_attention
        self.records: list[dict] = []
        self._trainer = None
        self._step_start = 0.0
        self._pending: dict | None = None

    # ------------------------------------------------------------------ setup
    def on_init_end(self, args, state, control, model=None, **kwargs):
        trainer = _calling_trainer(self)
        self._trainer = trainer
        world = check_launch(args)
        check_model_supported(
            model, max_document_tokens=self.tokens_per_rank * world, disaggregate=self.disaggregate
        )
        if trainer.train_dataset is None:
            raise ValueError("DistCACallback needs Trainer(train_dataset=...) with tokenized documents")
        documents = TokenDocuments(trainer.train_dataset, column=self.column)
        pad = self.pad_token_id
        if pad is None:
            pad = getattr(getattr(model, "config", None), "pad_token_id", None) or 0
        rank = args.process_index
        max_steps = args.max_steps if args.max_steps and args.max_steps > 0 else None
        batches = DistCABatches(
            documents,
            rank=rank,
            world_size=world,
            tokens_per_rank=self.tokens_per_rank,
            grad_accum=args.gradient_accumulation_steps,
            seed=args.seed if self.seed is None else self.seed,
            pad_token_id=int(pad),
            max_steps=max_steps,
            disaggregate=self.disaggregate,
        )
        if len(batches) == 0:
            raise ValueError(
                f"the dataset fills no optimizer step of {self.tokens_per_rank} tokens x {world} ranks x "
                f"{args.gradient_accumulation_steps} accumulation; add documents or lower tokens_per_rank"
            )
        self.batches = batches
        # the documented override point of Trainer, set on this instance only
        trainer.get_train_dataloader = lambda: DistCADataLoader(batches)
        return control

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        _check_same_documents(self.batches.documents.lengths, max(args.world_size, 1))
        if self.disaggregate:
            enable_distca(model, group=group, config=self.config)
        if not self.recompute_attention:
            switch_trainer_checkpointing(model, args)  # after the Trainer enabled checkpointing
        cfg = getattr(model, "config", None)
        heads = getattr(cfg, "num_attention_heads", 0) or 0
        head_dim = getattr(cfg, "head_dim", None) or (getattr(cfg, "hidden_size", 0) // max(heads, 1))
        self._flops_per_pair = 4.0 * heads * head_dim * (getattr(cfg, "num_hidden_layers", 0) or 0)
        metrics.reset()
        return control

    # ------------------------------------------------------------------ per step
    def on_step_begin(self, args, state, control, **kwargs):
        metrics.reset()
        self._step_start = time.perf_counter()
        return control

    def on_step_end(self, args, state, control, **kwargs):
        stats = metrics.snapshot(reset=True)
        elapsed = time.perf_counter() - self._step_start
        world = max(args.world_size, 1)
        tokens = self.tokens_per_rank * world * args.gradient_accumulation_steps
        sent = _gather_ints(stats.bytes_sent, world)
        received = _gather_ints(stats.bytes_received, world)
        step_time = max(_gather_floats(elapsed, world))
        layout_pairs = self.batches.pop_layout_pairs(args.gradient_accumulation_steps)
        if not stats.flops_before:
            # attention stayed local (baseline): each rank attends within its own pieces only
            flops = [p * self._flops_per_pair for p in layout_pairs]
            stats.flops_before, stats.flops_after = flops, list(flops)
        record = {
            "step": state.global_step,
            "loss": None,
            "tokens": tokens,
            "step_time_s": step_time,
            "attn_flops_before": stats.flops_before,
            "attn_flops_after": stats.flops_after,
            "imbalance_before": stats.imbalance_before,
            "imbalance_after": stats.imbalance_after,
            "bytes_sent": sent,
            "bytes_received": received,
            "plan_seconds": stats.plan_seconds,
            "engine_calls": stats.calls,
            "attn_fwd_kernels": _gather_ints(stats.attn_fwd_kernels, world),
        }
        self._pending = record
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._pending is not None and logs and "loss" in logs:
            self._pending["loss"] = float(logs["loss"])
            self._flush(args)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self._pending is not None:
            self._flush(args)
        if args.process_index == 0 and self.plot_file and self.records:
            from hf_distca.plotting import plot_attention_load

            plot_attention_load(self.records, os.path.join(args.output_dir, self.plot_file))
        return control

    def _flush(self, args) -> None:
        record, self._pending = self._pending, None
        self.records.append(record)
        if args.process_index == 0 and self.metrics_file:
            os.makedirs(args.output_dir, exist_ok=True)
            with open(os.path.join(args.output_dir, self.metrics_file), "a") as f:
                f.write(json.dumps(record) + "\n")

    @property
    def summary(self) -> dict:
        """Mean imbalance before/after over the steps recorded so far."""
        if not self.records:
            return {}
        n = len(self.records)
        return {
            "steps": n,
            "imbalance_before": sum(r["imbalance_before"] for r in self.records) / n,
            "imbalance_after": sum(r["imbalance_after"] for r in self.records) / n,
            "final_loss": self.records[-1]["loss"],
        }


def _calling_trainer(callback):
    """The Trainer whose ``__init__`` is running this callback's ``on_init_end``."""
    frame = inspect.currentframe()
    try:
        for _ in range(12):
            frame = frame.f_back
            if frame is None:
                break
            candidate = frame.f_locals.get("self")
            handler = getattr(candidate, "callback_handler", None)
            if handler is not None and callback in getattr(handler, "callbacks", []):
                return candidate
    finally:
        del frame
    raise RuntimeError(
        "DistCACallback must be given to a transformers Trainer: Trainer(..., callbacks=[DistCACallback(...)]). "
        "For plain Accelerate loops use hf_distca.data.DistCABatches and hf_distca.enable_distca instead."
    )


def _check_same_documents(lengths: list[int], world: int) -> None:
    """Every rank must plan from the same documents; compare a digest of their lengths."""
    digest = int.from_bytes(hashlib.sha256(repr(lengths).encode()).digest()[:6], "big")
    seen = _gather_floats(float(digest), world)
    if len(set(seen)) != 1:
        raise RuntimeError(
            "ranks see different training documents (their token lengths differ); every rank must load and "
            "tokenize the same dataset in the same order (same tokenizer, no per-rank shuffling)"
        )


def _gather_floats(value: float, world: int) -> list[float]:
    if world == 1 or not (dist.is_available() and dist.is_initialized()):
        return [float(value)]
    t = torch.tensor([float(value)], dtype=torch.float64, device=_collective_device())
    out = [torch.zeros_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return [float(x.item()) for x in out]


def _gather_ints(value: int, world: int) -> list[int]:
    return [int(x) for x in _gather_floats(float(value), world)]


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
