"""Fine-tune a Llama-style model on long documents with the HF Trainer and DistCA.

Runs under ``accelerate launch`` or ``torchrun`` (or plain ``python`` for one process). With no
arguments: a tiny random-init Llama, a tokenizer trained locally, generated long-tailed documents,
on the CPU. Writes ``<output-dir>/metrics.jsonl`` (one record per optimizer step), a PNG of per-rank
attention load, and the final model (``save_pretrained``).

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml recipes/finetune_long_docs.py
    torchrun --nproc-per-node 2 recipes/finetune_long_docs.py
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainingArguments

import hf_distca  # registers attn_implementation="distca"
from hf_distca.cli import add_config_arguments, config_from_args
from hf_distca.data.baselines import LAYOUTS

_TINY = dict(  # the tiny built-ins' shared shape
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=65536,
)
BUILTIN_MODELS = {
    # name: config fields (of LlamaConfig unless BUILTIN_CONFIG_CLASSES names another), random init, no download
    "tiny-llama": dict(_TINY),
    "llama3-8b-shaped": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        vocab_size=128256,
    ),
    # sliding-window models (distca computes each layer's window exactly; see README "Supported")
    "tiny-mistral": dict(_TINY, sliding_window=256),  # a window in every layer
    "tiny-gemma3": dict(
        _TINY,
        num_hidden_layers=3,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=256,
        sliding_window_pattern=3,  # 2 local (sliding) layers to 1 global, as Gemma 3's 5:1
    ),
    "gemma3-4b-shaped": dict(  # google/gemma-3-4b-pt's text model: 5 local layers (window 1024) to 1 global
        hidden_size=2560,
        intermediate_size=10240,
        num_hidden_layers=34,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        query_pre_attn_scalar=256,
        max_position_embeddings=131072,
        sliding_window=1024,
        vocab_size=262208,
    ),
}
BUILTIN_CONFIG_CLASSES = {
    "tiny-mistral": "MistralConfig",
    "tiny-gemma3": "Gemma3TextConfig",
    "gemma3-4b-shaped": "Gemma3TextConfig",
}
"""Built-in models' Transformers config class; LlamaConfig for the others."""
# --attn: distca balances core attention over ranks; the others are baselines on the same data path,
# attending only within each rank's own pieces ("local" runs the distca kernels without dispatch)
LENGTHS_VOCAB = 4096  # vocabulary of the --doc-lengths documents
ATTN = {"distca": "distca", "local": "distca", "sdpa": "sdpa", "flash": "flash_attention_2"}


# transformers 5.24 renamed TrainingArguments.gradient_checkpointing; 5.17 only has the old name
_CHECKPOINTING_ARG = (
    "activation_checkpointing"
    if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    else "gradient_checkpointing"
)


def build_parser(description: str = __doc__) -> argparse.ArgumentParser:
    """The recipe's flags (recipes/sft_trl.py takes the same)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default="tiny-llama",
        help="local path, hub id, or a built-in random-init "
        f"config: {', '.join(BUILTIN_MODELS)} (default: tiny-llama)",
    )
    p.add_argument(
        "--num-layers", type=int, default=None, help="override the layer count of a built-in model"
    )
    p.add_argument(
        "--dataset",
        default=None,
        help="hub dataset name, or a local .jsonl/.json/.parquet/.csv/.txt "
        "file; default: generated long-tailed documents",
    )
    p.add_argument("--dataset-split", default="train")
    p.add_argument("--text-column", default="text")
    p.add_argument(
        "--doc-lengths",
        default=None,
        help="JSON list of document lengths (e.g. a measured sample): "
        "train on generated token documents whose lengths are drawn from it (no tokenizer)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="default: the model's own; for a built-in model a BPE tokenizer trained locally on the data",
    )
    p.add_argument("--num-documents", type=int, default=400, help="generated documents (default data only)")
    p.add_argument(
        "--mean-doc-words", type=int, default=300, help="generated documents: mean length in words"
    )
    p.add_argument("--max-doc-words", type=int, default=2400, help="generated documents: max length in words")
    p.add_argument("--tokens-per-rank", type=int, default=2048)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--optim", default="adamw_torch", help="TrainingArguments.optim (e.g. adamw_torch, sgd)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--ddp-timeout",
        type=int,
        default=1800,
        help="seconds a collective of the process group (the engine's group under DDP, FSDP and ZeRO-3) may "
        "wait before the run fails (TrainingArguments.ddp_timeout; default 1800)",
    )
    p.add_argument("--output-dir", default="outputs/finetune_long_docs")
    p.add_argument("--attn", choices=sorted(ATTN), default="distca")
    p.add_argument(
        "--layout",
        choices=sorted(LAYOUTS),
        default="distca",
        help="how each global micro-batch is laid out over the ranks: distca (default: cost-balanced packing, "
        "hf_distca.data.layout_balanced), tokens (the token-only rebatcher, layout_pieces; the exact-unbalanced "
        "baseline with --max-planner-moves 0), hf-default (each rank packs whole documents in order; run with "
        "--attn local) or balanced (the same layout as distca; run with --max-planner-moves 0 as the "
        "WLB-LLM-style baseline); see hf_distca.data.baselines",
    )
    p.add_argument(
        "--liger",
        action="store_true",
        help="liger-kernel's fused linear cross-entropy (TrainingArguments(use_liger_kernel=True)): the "
        "logits are never materialized; CUDA GPUs only",
    )
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument(
        "--recompute-attention",
        action="store_true",
        help="with --gradient-checkpointing, recompute core attention in backward (plain Transformers "
        "checkpointing, for comparison); default: keep each layer's attention output (rematerialization-aware)",
    )
    p.add_argument(
        "--offload-activations",
        action="store_true",
        help="with --gradient-checkpointing, keep each decoder layer's checkpointed input in host memory (copied "
        "on a side stream, brought back a layer ahead in backward; hf_distca.OffloadOptions(inputs=True))",
    )
    p.add_argument(
        "--kept-attention",
        default="gpu",
        help="with rematerialization-aware --gradient-checkpointing (--attn distca or local): where each layer keeps "
        "its attention output until backward: gpu (default), host, drop (recomputed in backward), auto (chosen "
        "at the first step from free GPU and host memory), or one of gpu/host/drop per layer, comma-separated",
    )
    p.add_argument(
        "--tiled-mlp",
        type=int,
        default=None,
        metavar="TOKENS",
        help="run each decoder layer's MLP over tiles of TOKENS tokens (0: the model's hidden size), keeping only "
        "its input for backward (hf_distca.tile_mlp)",
    )
    p.add_argument(
        "--tiled-norms",
        type=int,
        default=None,
        metavar="TOKENS",
        help="run the decoder layers' norms and the final norm over tiles of TOKENS tokens (0: the hidden size), "
        "keeping only their input for backward: no float32 copies of the hidden states (hf_distca.tile_norms)",
    )
    p.add_argument("--bf16", action="store_true")
    p.add_argument(
        "--torch-compile",
        default=None,
        metavar="BACKEND",
        help="compile the model with torch.compile through the Trainer (TrainingArguments(torch_compile=True, "
        "torch_compile_backend=BACKEND), e.g. inductor); distca's core attention runs as opaque custom ops inside",
    )
    p.add_argument("--cpu", action="store_true", help="train on the CPU even if GPUs are present")
    p.add_argument("--deepspeed", default=None, help="DeepSpeed JSON config (or use an accelerate config)")
    p.add_argument("--no-save", action="store_true", help="skip saving the final model")
    p.add_argument(
        "--memory-snapshot",
        action="store_true",
        help="CUDA only: record the CUDA allocator's history during the last step and write the blocks live at its "
        "peak, by the code that allocated them, to OUTPUT_DIR/memory_snapshot_rank<R>.json "
        "(hf_distca.memory_snapshot; slows that step)",
    )
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N optimizer steps (0: none)")
    p.add_argument(
        "--resume-from-checkpoint", default=None, help="a checkpoint directory of an earlier run to continue"
    )
    add_config_arguments(p)  # every DistCAConfig field, e.g. --tolerance, --shard-tokens, --backend
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


@contextlib.contextmanager
def built_whole(training_args):
    """Build models whole on every rank, even when ``training_args`` enabled DeepSpeed ZeRO-3.

    Under ZeRO-3 Transformers builds a model inside ``deepspeed.zero.Init``: parameters are partitioned
    as they are created and random init runs afterwards on rank 0, drawing the random numbers in
    another order than a plain build, so the same seed gives other weights than under DDP or FSDP.
    Built whole, a random-init model gets the same weights under every parallelism; DeepSpeed
    partitions it when the Trainer wraps the model. (Checkpoints load their weights and keep
    zero.Init's memory savings: only the built-in random-init models are built this way.)
    """
    from transformers.integrations import (
        is_deepspeed_zero3_enabled,
        set_hf_deepspeed_config,
        unset_hf_deepspeed_config,
    )

    plugin = getattr(training_args, "deepspeed_plugin", None)
    # the object through which Transformers sees the DeepSpeed config: the Trainer's (--deepspeed) or
    # Accelerate's (accelerate launch with a DeepSpeed config)
    holder = getattr(training_args, "hf_deepspeed_config", None) or getattr(plugin, "dschf", None)
    if holder is None or not is_deepspeed_zero3_enabled():
        yield
        return
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(holder)


def builtin_config(name: str, **overrides):
    """The Transformers config of built-in model ``name`` (random init, no download), with ``overrides``."""
    import transformers

    config_class = getattr(transformers, BUILTIN_CONFIG_CLASSES.get(name, "LlamaConfig"))
    return config_class(**{**BUILTIN_MODELS[name], **overrides}, tie_word_embeddings=False)


def build_model(args, vocab_size: int, dtype: torch.dtype, training_args=None):
    attn = ATTN[args.attn]
    if args.model in BUILTIN_MODELS:
        overrides = {"vocab_size": max(BUILTIN_MODELS[args.model].get("vocab_size", vocab_size), vocab_size)}
        if args.num_layers:
            overrides["num_hidden_layers"] = args.num_layers
        config = builtin_config(args.model, **overrides)
        torch.manual_seed(args.seed)  # seeds every device: identical weights on every rank
        # random init on the rank's GPU is much faster than on the CPU for billion-parameter shapes
        device = (
            f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            if torch.cuda.is_available() and not args.cpu
            else "cpu"
        )
        with torch.device(device), built_whole(training_args):
            return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    config = AutoConfig.from_pretrained(args.model)
    if config.vocab_size < vocab_size:
        raise ValueError(
            f"tokenizer has {vocab_size} ids but {args.model} only {config.vocab_size} embeddings"
        )
    return AutoModelForCausalLM.from_pretrained(args.model, attn_implementation=attn, dtype=dtype)


def load_texts(args) -> list[str] | None:
    """Plain-text documents of the default generated dataset (None when --dataset is given)."""
    if args.dataset is not None:
        return None
    from hf_distca.data import generate_text_documents

    return generate_text_documents(
        args.num_documents, seed=args.seed, mean_words=args.mean_doc_words, max_words=args.max_doc_words
    )


def load_dataset_rows(args):
    import datasets

    path = args.dataset
    ext = os.path.splitext(path)[1].lower()
    builders = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
    if os.path.exists(path):
        if ext not in builders:
            raise ValueError(f"unsupported local dataset file {path!r}; use one of {sorted(builders)}")
        ds = datasets.load_dataset(builders[ext], data_files=path, split="train")
    else:
        ds = datasets.load_dataset(path, split=args.dataset_split)
    if args.text_column not in ds.column_names:
        raise ValueError(
            f"dataset {path!r} has no column {args.text_column!r} (columns: {ds.column_names}); pass --text-column"
        )
    return ds


def train_local_tokenizer(texts, vocab_size: int = 2048):
    """A small byte-level BPE trained on the data itself (no downloads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def tokenize(texts_or_rows, tokenizer, text_column: str):
    """Token-id documents with EOS appended: rows with an ``input_ids`` column (a list of dicts for
    in-memory texts, a datasets.Dataset for loaded ones)."""
    eos = tokenizer.eos_token_id

    def encode(texts):
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [x + [eos] if eos is not None else x for x in ids]

    if isinstance(texts_or_rows, list):
        from tqdm.auto import tqdm

        out = []
        for i in tqdm(range(0, len(texts_or_rows), 256), desc="tokenizing", disable=not _is_main()):
            out += [{"input_ids": ids} for ids in encode(texts_or_rows[i : i + 256])]
        return out
    rows = texts_or_rows
    return rows.map(
        lambda batch: {"input_ids": encode(batch[text_column])},
        batched=True,
        remove_columns=rows.column_names,
        desc="tokenizing",
    )


def _is_main() -> bool:
    return os.environ.get("RANK", "0") == "0"


def documents_from_lengths(args) -> tuple[list[dict], int]:
    """Generated token documents whose lengths are drawn (seeded) from a JSON list of lengths."""
    import numpy as np

    from hf_distca.data import documents_with_lengths

    with open(args.doc_lengths) as f:
        sample = json.load(f)
    if not isinstance(sample, list) or not sample:
        raise ValueError(f"{args.doc_lengths} must hold a non-empty JSON list of document lengths")
    lengths = np.random.default_rng(args.seed).choice(
        np.asarray(sample, dtype=np.int64), size=args.num_documents
    )
    docs = documents_with_lengths(lengths.tolist(), vocab_size=LENGTHS_VOCAB, seed=args.seed)
    return [{"input_ids": d} for d in docs], LENGTHS_VOCAB


def load_and_tokenize(args, training_args):
    """Texts (generated, or --dataset) tokenized with --tokenizer, the model's, or a local BPE."""
    texts = load_texts(args)
    rows = load_dataset_rows(args) if texts is None else None
    if args.tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    elif args.model in BUILTIN_MODELS:
        # trained once by the main process and loaded by the others: every rank must get the same ids
        path = os.path.join(args.output_dir, "tokenizer")
        with training_args.main_process_first(desc="training the tokenizer"):
            if training_args.process_index == 0:
                sample = texts[:200] if texts is not None else rows[args.text_column][:2000]
                train_local_tokenizer(sample).save_pretrained(path)
            tokenizer = AutoTokenizer.from_pretrained(path)
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    documents = tokenize(texts if texts is not None else rows, tokenizer, args.text_column)
    return tokenizer, documents


LIGER_CONFIG = {"fused_linear_cross_entropy": True, "cross_entropy": False, "rope": False, "rms_norm": False,
                "swiglu": False}  # fmt: skip
"""--liger: only the fused linear cross-entropy. It scores the batch's pre-shifted ``shift_labels`` and
divides by the Trainer's ``num_items_in_batch`` (liger-kernel's ``LigerForCausalLMLoss``), the same
normalisation as the model's own loss; the layer kernels (RoPE, RMSNorm, SwiGLU) are left out: they
replace Transformers module classes process-wide and are a separate speed choice."""


def check_liger(args, use_cpu: bool, model_type: str | None = None) -> None:
    """--liger needs a CUDA device and (once the model is built) a model type liger-kernel patches,
    else it would do nothing."""
    if not args.liger:
        return
    if use_cpu:
        raise ValueError(
            "--liger needs a CUDA GPU: liger-kernel's fused linear cross-entropy is a Triton kernel. "
            "Leave out --liger on the CPU (the loss is the same, with the logits materialized)"
        )
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as err:
        raise ValueError("--liger needs liger-kernel: pip install -e .[liger]") from err
    if model_type is not None and model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ValueError(
            f"--liger: liger-kernel has no kernels for model_type={model_type!r} (it would silently do nothing); "
            f"supported: {sorted(MODEL_TYPE_TO_APPLY_LIGER_FN)}"
        )


def check_parallelism(args, training_args) -> None:
    """Refuse parallelism settings a run would silently not honour.

    FSDP on the CPU: Accelerate enables FSDP only on accelerator devices (its CPU processes are plain
    ``MULTI_CPU``), so the Trainer would train with DDP whatever ``fsdp``/``fsdp_config`` or an
    ``accelerate launch`` FSDP config asked for. A DeepSpeed config with its own ``optimizer`` section:
    DeepSpeed builds that optimizer and ``--optim`` is ignored.
    """
    fsdp_asked = bool(training_args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if fsdp_asked and training_args.use_cpu:
        raise ValueError(
            "FSDP needs GPUs: Accelerate turns FSDP on only for accelerator devices, and on the CPU the Trainer "
            "would train with plain DDP instead. On the CPU use DDP (accelerate_configs/cpu_2proc.yaml or torchrun) "
            "or DeepSpeed ZeRO-3 (--deepspeed accelerate_configs/ds_zero3.json)"
        )
    holder = getattr(training_args, "hf_deepspeed_config", None)
    default_optim = build_parser().get_default("optim")
    if holder is not None and "optimizer" in holder.config and args.optim != default_optim:
        raise ValueError(
            f"--optim {args.optim} would be ignored: the DeepSpeed config {args.deepspeed} defines its own "
            f'optimizer ({holder.config["optimizer"].get("type")}). Remove its "optimizer" section (and set '
            '"zero_allow_untested_optimizer": true, and with "offload_optimizer" "zero_force_ds_cpu_optimizer": '
            "false) to step the Trainer's optimizer, or leave out --optim"
        )


def training_kwargs(args) -> dict:
    """The TrainingArguments of a run (also the base of recipes/sft_trl.py's SFTConfig)."""
    use_cpu = args.cpu or not torch.cuda.is_available()
    return dict(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.learning_rate,
        optim=args.optim,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="steps" if args.save_steps > 0 else "no",
        **({"save_steps": args.save_steps} if args.save_steps > 0 else {}),
        report_to=[],
        seed=args.seed,
        use_cpu=use_cpu,
        bf16=args.bf16,
        **{_CHECKPOINTING_ARG: args.gradient_checkpointing},
        remove_unused_columns=False,
        ddp_find_unused_parameters=False,
        ddp_timeout=args.ddp_timeout,
        dataloader_num_workers=0,
        deepspeed=args.deepspeed,
        disable_tqdm=False,
        use_liger_kernel=args.liger,
        **({"liger_kernel_config": dict(LIGER_CONFIG)} if args.liger else {}),
        **(
            {"torch_compile": True, "torch_compile_backend": args.torch_compile} if args.torch_compile else {}
        ),
    )


def prepare(args, training_args):
    """(tokenizer or None, tokenized documents, model, DistCACallback) of a run."""
    check_liger(args, training_args.use_cpu)
    check_parallelism(args, training_args)
    tokenizer = None
    if args.doc_lengths:
        if args.dataset:
            raise ValueError("--doc-lengths and --dataset exclude each other: pick one data source")
        documents, vocab_size = documents_from_lengths(args)
    else:
        tokenizer, documents = load_and_tokenize(args, training_args)
        vocab_size = len(tokenizer)

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = build_model(args, vocab_size, dtype, training_args)
    check_liger(args, training_args.use_cpu, model.config.model_type)
    if args.gradient_checkpointing:
        model.config.use_cache = False

    kept = args.kept_attention.split(",") if "," in args.kept_attention else args.kept_attention
    offload = hf_distca.OffloadOptions(inputs=args.offload_activations, kept_attention=kept)
    callback = hf_distca.DistCACallback(
        args.tokens_per_rank,
        config=config_from_args(args),
        disaggregate=args.attn == "distca",
        pad_token_id=(tokenizer.pad_token_id if tokenizer is not None else None) or 0,
        recompute_attention=args.recompute_attention,
        # distca: the callback's default, cost-balanced and node-aware when the config names nodes
        layout=None if args.layout == "distca" else LAYOUTS[args.layout],
        offload=offload if offload.active else None,
        tiled_mlp=args.tiled_mlp,
        tiled_norms=args.tiled_norms,
    )
    return tokenizer, documents, model, callback


def main(argv=None) -> dict:
    args = parse_args(argv)
    training_args = TrainingArguments(**training_kwargs(args))
    tokenizer, documents, model, callback = prepare(args, training_args)
    callbacks = [callback]
    if args.memory_snapshot:
        if args.max_steps < 1:
            raise ValueError("--memory-snapshot records the last step: give --max-steps N (N >= 1)")
        if not torch.cuda.is_available() or training_args.use_cpu:
            raise ValueError(
                "--memory-snapshot records the CUDA allocator: it needs a CUDA GPU; leave it out on the CPU"
            )
        from hf_distca.memory_snapshot import peak_step_callback

        path = os.path.join(args.output_dir, f"memory_snapshot_rank{training_args.process_index}.json")
        callbacks.append(peak_step_callback(args.max_steps, path))
    trainer = hf_distca.DistCATrainer(
        model=model, args=training_args, train_dataset=documents, callbacks=callbacks
    )
    return finish(args, trainer, callback, tokenizer)


def finish(args, trainer, callback, tokenizer) -> dict:
    """Train, save, print the balance and write ``summary.json`` (with every rank's peak GPU memory)."""
    training_args = trainer.args
    metrics_path = os.path.join(args.output_dir, callback.metrics_file)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    summary = dict(
        callback.summary,
        world_size=training_args.world_size,
        attn=args.attn,
        layout=args.layout,
        # the engine the Trainer trained: DistributedDataParallel, DeepSpeedEngine, an FSDP2 model class, ...
        wrapped=type(trainer.model_wrapped).__name__,
        zero_offload=zero_offload(trainer),
        peak_memory_gib=peak_memory_gib(training_args.world_size),
        peak_reserved_gib=peak_memory_gib(training_args.world_size, reserved=True),
        memory=memory_report(args, trainer, callback),
    )
    if not args.no_save:
        trainer.save_model(os.path.join(args.output_dir, "model"))
        if training_args.process_index == 0 and tokenizer is not None:
            tokenizer.save_pretrained(os.path.join(args.output_dir, "model"))
    if training_args.process_index == 0:
        print(
            f"[hf_distca] {summary.get('steps', 0)} steps on {summary['world_size']} rank(s), attn={args.attn}, "
            f"layout={args.layout}: core-attention imbalance (max/mean over ranks) "
            f"{summary.get('imbalance_token_layout', 1):.2f} with token-only packing, "
            f"{summary.get('imbalance_before', 1):.2f} with this layout, "
            f"{summary.get('imbalance_after', 1):.2f} "
            f"{'after planning' if args.attn == 'distca' else 'in this run (no planning)'}; final loss "
            f"{summary.get('final_loss')}; metrics in {metrics_path}",
            flush=True,
        )
        with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary


def zero_offload(trainer) -> dict[str, bool]:
    """Whether DeepSpeed ZeRO-3 kept this run's weights (``param``) and optimizer state (``optimizer``) in
    host memory: the flags of its ZeRO-3 optimizer (both False under any other parallelism)."""
    optimizer = getattr(trainer.model_wrapped, "optimizer", None)
    return {what: bool(getattr(optimizer, f"offload_{what}", False)) for what in ("param", "optimizer")}


def memory_report(args, trainer, callback) -> dict:
    """The memory options' report (callback.memory_report) and this rank's memory by owner at the peak
    (hf_distca.memory_owners: weights, gradients, optimizer state, checkpointed inputs, kept attention
    outputs, the rest), in GiB."""
    from hf_distca.memory_owners import memory_by_owner

    on_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    by_owner = memory_by_owner(
        trainer.model,
        trainer.optimizer,
        tokens=args.tokens_per_rank,
        compute_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        remat=args.gradient_checkpointing and not args.recompute_attention and ATTN[args.attn] == "distca",
        peak_allocated=torch.cuda.max_memory_allocated() if on_cuda else None,
    )
    return {**callback.memory_report, "by_owner": by_owner}


def peak_memory_gib(world: int, *, reserved: bool = False) -> list[float] | None:
    """Every rank's peak allocated (``reserved``: reserved by the caching allocator) CUDA memory in GiB
    (None on the CPU); all ranks call it together."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    peak_bytes = torch.cuda.max_memory_reserved() if reserved else torch.cuda.max_memory_allocated()
    peak = torch.tensor([peak_bytes / 2**30], dtype=torch.float64, device="cuda")
    if world > 1 and torch.distributed.is_initialized():
        out = [torch.empty_like(peak) for _ in range(world)]
        torch.distributed.all_gather(out, peak)
        return [round(float(t), 3) for t in out]
    return [round(float(peak), 3)]


def end_process_group() -> None:
    """Destroy the default process group while the interpreter is still alive (after every rank is done).

    gloo's worker threads must be joined before interpreter finalization: a group torn down there can abort
    the process ("terminate called without an active exception") after training succeeded. The finished
    runs' DDP reducers hold the group, so they are collected first.
    """
    gc.collect()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    summary = main()
    end_process_group()
    sys.exit(0 if summary is not None else 1)
