"""Train the same long documents as finetune_long_docs.py with Accelerate's sequence/context parallelism.

The two baselines of benchmarks/suite.py that users turn on through Accelerate's ``ParallelismConfig``
(``TrainingArguments(parallelism_config=...)``) instead of DistCA, on the documents DistCA trains (same
seed, same global batches; every flag of finetune_long_docs.py that concerns the model and the data):

- ``--parallelism ulysses``: DeepSpeed Ulysses / ALST (``sp_backend="deepspeed"``, ``sp_size`` = the
  world size), under ZeRO-3. Every step's global micro-batch (``world x --tokens-per-rank`` tokens, the
  documents DistCA gets) is one packed row with ``position_ids`` restarting at each document;
  DeepSpeed's dataloader adapter cuts it into ``sp_size`` contiguous shards and, in every layer,
  ``UlyssesSPAttentionHF`` all-to-alls q/k/v from sequence shards to head shards, runs the core
  attention on the whole row for its ``heads / sp_size`` heads, and all-to-alls the output back.
  The core attention is ``--attn``: ``distca`` (default) is hf_distca's attention function without a
  layout, i.e. exact causal attention inside each document, boundaries from the gathered
  ``position_ids``, on the varlen kernel ``--backend`` picks (``torch_varlen`` on CUDA,
  ``reference`` on the CPU): flash-attn, which Ulysses users would pick, is not installable on the GPU
  image. ``sdpa`` is what works with no extra package: DeepSpeed drops the mask and SDPA runs causal
  over the whole row, so documents see each other (**not exact**). Accelerate 1.15's
  ``DeepSpeedSequenceParallelConfig`` names only flash_attention_2/3, sdpa and hub flash kernels,
  while DeepSpeed takes any registered attention key: the recipe sets ``sp_attn_implementation`` to
  ``distca`` after the config's own validation. Heads must divide by ``sp_size`` and KV heads must
  divide by it or divide it (fewer KV heads than ranks are replicated); otherwise DeepSpeed raises.
  ZeRO-3 only, the configuration tested exact (tests/test_sequence_parallel.py); the recipe checks the
  engine DeepSpeed built at the first step and refuses another stage (``RequireZero3``): under ZeRO-0/1
  DeepSpeed 0.19.8 summed the sequence-parallel ranks' gradients instead of averaging them, while
  Transformers' SP loss already scales each rank's gradient by ``sp_size``.
- ``--parallelism torch-cp``: torch context parallelism (``cp_size`` = the world size, FSDP2, SDPA;
  CUDA only: torch has no sharding rule for the CPU SDPA kernel). Accelerate replaces every
  attention mask with ``is_causal=True``, so packed documents attend to each other: **not exact**
  (tests/test_sequence_parallel.py shows the leak); it is in the suite to show what users get.

Writes ``metrics.jsonl`` (one record per step, the fields benchmarks/suite.py reads) and
``summary.json`` (peak memory per rank) like finetune_long_docs.py. Runs under torchrun with N >= 2
processes (on the CPU too for ``ulysses``, with gloo):

    torchrun --nproc-per-node 2 recipes/sequence_parallel_long_docs.py --parallelism ulysses
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import time

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import finetune_long_docs as base  # noqa: E402

import hf_distca  # noqa: E402
from hf_distca.cli import config_from_args  # noqa: E402
from hf_distca.data.loader import DistCABatches  # noqa: E402

PARALLELISMS = ("ulysses", "torch-cp")
ZERO3 = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 2**31 - 1,
}
"""The DeepSpeed config of ``--parallelism ulysses``: ZeRO-3 (as DeepSpeed's ALST tutorial runs it), the
Trainer's optimizer (``--optim``; DeepSpeed's fused Adam does not build on the GPU image), "auto"
fields filled by the Trainer from the recipe's flags."""


def build_parser():
    p = base.build_parser(__doc__)
    p.add_argument("--parallelism", choices=PARALLELISMS, default="ulysses")
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    if args.layout != "distca":
        p.error(f"--layout {args.layout}: sequence parallelism packs each global micro-batch into one row")
    if args.parallelism == "torch-cp" and args.attn != "sdpa":
        p.error("--parallelism torch-cp runs SDPA only (Accelerate's context parallelism): pass --attn sdpa")
    if args.parallelism == "ulysses" and args.attn not in ("distca", "local", "sdpa", "flash"):
        p.error(f"--attn {args.attn} is not a core attention for Ulysses")
    if args.deepspeed:
        p.error("--deepspeed: this recipe sets its own DeepSpeed config (ZERO3)")
    memory = {"--offload-activations": args.offload_activations, "--kept-attention": args.kept_attention != "gpu",
              "--tiled-mlp": args.tiled_mlp is not None, "--tiled-norms": args.tiled_norms is not None}  # fmt: skip
    if any(memory.values()):
        p.error(
            f"{', '.join(k for k, v in memory.items() if v)}: DistCACallback's memory options; this recipe trains "
            "without it. Use recipes/finetune_long_docs.py (or sft_trl.py) for them"
        )
    return args


def packed_rows(documents, args, world: int) -> list[dict]:
    """One row per micro-batch: the global micro-batches of finetune_long_docs.py (same seed, same budget
    ``world x tokens_per_rank``), each packed into one sequence with ``position_ids`` restarting per document
    and unshifted ``labels`` (-100 at each document start and at padding)."""
    batches = DistCABatches(
        documents,
        rank=0,
        world_size=1,
        tokens_per_rank=world * args.tokens_per_rank,
        grad_accum=args.grad_accum,
        seed=args.seed,
        max_steps=args.max_steps,
        disaggregate=True,
        pad_to_budget=True,  # every row world x tokens_per_rank long: Ulysses cuts it evenly over the ranks
    )
    rows = []
    for epoch in itertools.count():
        batches.set_epoch(epoch)
        for batch in batches:
            shift = batch["shift_labels"]  # (1, T): target of token i, -100 where token i ends a document
            if int(shift[0, -1]) != -100:
                raise AssertionError(
                    "the last token of a packed row has a target: a document ran past the row"
                )
            labels = torch.nn.functional.pad(shift[:, :-1], (1, 0), value=-100)  # (1, T), unshifted
            rows.append(
                {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "labels": labels}
            )
            if len(rows) == args.max_steps * args.grad_accum:
                return rows


def collate(rows: list[dict]) -> dict:
    return {key: torch.cat([r[key] for r in rows]) for key in rows[0]}  # (B, T) each


def all_to_all_bytes(config, tokens_per_rank: int, sp: int, element_bytes: int, passes: int) -> int:
    """Bytes one rank sends per micro-batch in Ulysses' all-to-alls, from the tensor shapes.

    Per layer and pass (forward, backward, the recomputed forward of checkpointing): q, k, v from sequence
    to head shards and the output back (gradients the same way in backward); a rank keeps 1/sp of each.
    KV heads fewer than ``sp`` are replicated to ``sp`` before the exchange, as DeepSpeed does."""
    heads = config.num_attention_heads
    kv_heads = max(config.num_key_value_heads, sp)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_layer = tokens_per_rank * head_dim * (2 * heads + 2 * kv_heads) * (sp - 1) // sp
    return per_layer * element_bytes * config.num_hidden_layers * passes


class SequenceParallelTrainer(Trainer):
    """The Trainer with the micro-batch losses kept unrounded for the metrics."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.micro_batch_losses: list[float] = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch=num_items_in_batch)
        loss = out[0] if return_outputs else out
        self.micro_batch_losses.append(float(loss.detach()))
        return out


class RequireZero3(TrainerCallback):
    """What ``--parallelism ulysses`` relies on to equal one process, checked on the engine DeepSpeed built
    (at the first step, on every rank alike, before any collective of the step): ZeRO stage 3, as
    tests/test_sequence_parallel.py tests it exact. Under other stages DeepSpeed reduces the
    sequence-parallel ranks' gradients otherwise (0.19.8's ZeRO-1 sums them, each already ``sp_size`` x its
    share through Transformers' all-gathered SP loss), which would train silently off the single-process run."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        engine = self.trainer.model_wrapped
        stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else None
        if stage != 3:
            raise RuntimeError(
                f"--parallelism ulysses is exact under DeepSpeed ZeRO-3 only, but the engine runs ZeRO stage {stage} "
                "(the recipe's ZERO3 config sets stage 3): under other stages the sequence-parallel ranks' gradients "
                "are not averaged as one process's. Keep the recipe's ZeRO-3 config"
            )


class StepMetrics(TrainerCallback):
    """One metrics.jsonl record per optimizer step, with the fields of DistCACallback's that the suite reads."""

    def __init__(self, trainer: SequenceParallelTrainer, path: str, tokens: int, bytes_sent: int | None):
        self.trainer, self.path, self.tokens, self.bytes_sent = trainer, path, tokens, bytes_sent
        self.records: list[dict] = []

    def on_train_begin(self, args, state, control, **kwargs):
        if args.process_index == 0:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            open(self.path, "w").close()

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer.micro_batch_losses.clear()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        elapsed = time.perf_counter() - self._start
        rows = [[elapsed, statistics.fmean(self.trainer.micro_batch_losses)]]  # per rank: seconds, loss
        world = max(args.world_size, 1)
        if world > 1:
            device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
            mine = torch.tensor(rows[0], dtype=torch.float64, device=device)
            out = [torch.empty_like(mine) for _ in range(world)]
            torch.distributed.all_gather(out, mine)
            rows = [t.tolist() for t in out]
        record = {
            "step": state.global_step,
            # mean over ranks (as DistCACallback's); under Ulysses every rank holds the whole micro-batch loss
            "loss": statistics.fmean(row[1] for row in rows),
            "tokens": self.tokens,
            "step_time_s": max(row[0] for row in rows),
            # even by construction: each rank computes 1/world of the heads of every document (Ulysses) or a
            # head-tail balanced 1/world of the whole row's causal attention (torch CP)
            "imbalance_before": 1.0,
            "imbalance_after": 1.0,
        }
        if self.bytes_sent is not None:
            record["bytes_sent"] = [self.bytes_sent] * world
        self.records.append(record)
        if args.process_index == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def parallelism_config(args, world: int):
    """Accelerate's ParallelismConfig as users write it for each parallelism."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    if args.parallelism == "torch-cp":
        return ParallelismConfig(cp_size=world)
    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
    # DeepSpeed wraps the model's own attention key (it must equal sp_attn_implementation)
    handler.sp_attn_implementation = base.ATTN[args.attn]
    return ParallelismConfig(sp_backend="deepspeed", sp_size=world, sp_handler=handler)


def training_kwargs(args, world: int) -> dict:
    kwargs = base.training_kwargs(args)
    kwargs["train_sampling_strategy"] = "sequential"  # the suite's step i is the documents' step i
    kwargs["parallelism_config"] = parallelism_config(args, world)
    if args.parallelism == "ulysses":
        kwargs["deepspeed"] = dict(ZERO3)
    else:
        kwargs["fsdp"] = "full_shard"
        kwargs["fsdp_config"] = {"version": 2, "reshard_after_forward": True,
                                 "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}  # fmt: skip
    return kwargs


def main(argv=None) -> dict:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2:
        raise SystemExit(
            f"{args.parallelism} needs >= 2 processes (torchrun --nproc-per-node N), got {world}"
        )
    use_cpu = args.cpu or not torch.cuda.is_available()
    if args.parallelism == "torch-cp" and use_cpu:
        raise SystemExit(
            "--parallelism torch-cp needs CUDA GPUs: Accelerate runs cp_size only under FSDP2, which it does not "
            "enable on the CPU, and torch's context parallel has no rule for the CPU SDPA kernel"
        )
    if args.parallelism == "ulysses" and use_cpu:
        # Accelerate's CPU path brings up torch.distributed itself and never deepspeed.comm, whose
        # sequence-parallel groups DeepSpeed asserts; bringing it up first (gloo) keeps Accelerate's CPU
        # process count, so each rank loads its own rows as on GPUs
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    training_args = TrainingArguments(**training_kwargs(args, world))
    base.check_liger(args, training_args.use_cpu)
    if args.doc_lengths:
        documents, vocab_size = base.documents_from_lengths(args)
        tokenizer = None
    else:
        tokenizer, documents = base.load_and_tokenize(args, training_args)
        vocab_size = len(tokenizer)
    model = base.build_model(args, vocab_size, torch.bfloat16 if args.bf16 else torch.float32, training_args)
    base.check_liger(args, training_args.use_cpu, model.config.model_type)
    if args.gradient_checkpointing:
        model.config.use_cache = False
    if base.ATTN[args.attn] == "distca":  # the kernel backend of the local, document-aware attention
        hf_distca.enable_distca(model, config=config_from_args(args))
    rows = packed_rows(documents, args, world)
    trainer = SequenceParallelTrainer(
        model=model, args=training_args, train_dataset=rows, data_collator=collate
    )
    passes = 3 if args.gradient_checkpointing else 2
    element_bytes = 2 if args.bf16 else 4
    sent = (
        all_to_all_bytes(model.config, args.tokens_per_rank, world, element_bytes, passes) * args.grad_accum
        if args.parallelism == "ulysses"
        else None  # torch CP's ring exchanges are not counted
    )
    metrics = StepMetrics(
        trainer, os.path.join(args.output_dir, "metrics.jsonl"), world * args.tokens_per_rank, sent
    )
    if args.parallelism == "ulysses":
        trainer.add_callback(RequireZero3(trainer))
    trainer.add_callback(metrics)
    trainer.train()
    summary = {
        "steps": len(metrics.records),
        "final_loss": metrics.records[-1]["loss"] if metrics.records else None,
        "world_size": world,
        "parallelism": args.parallelism,
        "attn": args.attn,
        "peak_memory_gib": base.peak_memory_gib(world),
    }
    if not args.no_save:
        trainer.save_model(os.path.join(args.output_dir, "model"))
    if training_args.process_index == 0:
        print(f"[{args.parallelism}] {summary['steps']} steps on {world} ranks, attn={args.attn}: final loss "
              f"{summary['final_loss']}", flush=True)  # fmt: skip
        with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary


if __name__ == "__main__":
    summary = main()
    base.end_process_group()
    sys.exit(0 if summary is not None else 1)
