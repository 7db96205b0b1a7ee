"""Step time and peak memory: no checkpointing vs plain recompute vs rematerialization-aware checkpointing.

Run with torchrun on 1 or more GPUs. One process group, one model (the recipe's ``llama3-8b-shaped`` with
``--layers`` layers, bf16, attn_implementation="distca", DDP over the GPUs), and for every length sample
the same micro-batches (hf_distca.data.DistCABatches, ``--tokens-per-rank`` tokens per rank) trained
with each checkpointing mode in turn:

- ``none``: no activation checkpointing;
- ``recompute``: Transformers' activation checkpointing (non-reentrant) that re-runs each layer, core
  attention included, in backward (the recipe's ``--recompute-attention``);
- ``remat``: hf_distca.enable_remat_checkpointing (the recipe's default with --gradient-checkpointing):
  the recompute reuses each layer's attention output and log-sum-exp.

A step is forward + backward + SGD update (no optimizer state, so the figures are model, gradients and
activations). The loss is token-weighted cross-entropy computed in chunks of ``--loss-chunk`` tokens whose
logits are recomputed in backward (as fused/chunked cross-entropy kernels do in long-context training):
otherwise the 64K x 128K float32 logits alone would dominate memory. Reported per mode: median step time
(slowest rank) over ``--steps`` steps after ``--warmup``, peak allocated memory (max over ranks), forward
core-attention kernel runs per step and core-attention bytes sent per step; plus the time of the core-
attention forward alone for the same batches (all layers), which is what ``remat`` should save per step
compared with ``recompute``.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/bench_remat.py --layers 8 \\
        --doc-lengths mix --doc-lengths prolong=data/doclens_prolong.json --out results.md
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shlex
import statistics
import sys
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import hf_distca
from hf_distca import DistCAConfig, core_attention, enable_distca, metrics
from hf_distca.data import DistCABatches, documents_with_lengths
from hf_distca.data.baselines import LAYOUTS
from hf_distca.data.rebatch import LayoutFn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB_DOCS = 32000  # token ids of the generated documents (the model's vocabulary stays 128K)
MODES = ("remat", "recompute", "none")
DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16


def recipe_model_shape(name: str) -> dict:
    spec = importlib.util.spec_from_file_location(
        "recipe", os.path.join(ROOT, "recipes", "finetune_long_docs.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.BUILTIN_MODELS[name])


def long_document_mix(seed: int) -> list[int]:
    """Generated lengths: ~2/3 of the tokens in documents of 16K-128K (log-uniform), the rest short
    (log-normal, median 1.5K)."""
    rng = np.random.default_rng(seed)
    long = np.exp(rng.uniform(np.log(16384), np.log(131072), 300)).astype(np.int64)
    short = np.clip(rng.lognormal(np.log(1500), 1.0, 3000), 32, 16383).astype(np.int64)
    return [int(x) for x in np.concatenate([long, short])]


def load_lengths(spec: str, seed: int) -> tuple[str, list[int]]:
    if spec == "mix":
        return "mix", long_document_mix(seed)
    name, _, path = spec.partition("=")
    if not path:
        name, path = os.path.splitext(os.path.basename(spec))[0], spec
    with open(path) as f:
        return name, [int(x) for x in json.load(f)]


class LossModel(torch.nn.Module):
    """Causal LM whose token-weighted cross-entropy is computed in chunks (logits recomputed in backward)."""

    def __init__(self, lm: torch.nn.Module, chunk: int):
        super().__init__()
        self.lm, self.chunk = lm, chunk

    @staticmethod
    def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = (hidden @ weight.t()).float()  # (c, V)
        return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")

    def forward(self, input_ids, position_ids, shift_labels, distca_layout, num_targets: int):
        hidden = self.lm.model(
            input_ids=input_ids, position_ids=position_ids, distca_layout=distca_layout, use_cache=False
        ).last_hidden_state[0]  # (T, H)
        labels = shift_labels[0]
        weight = self.lm.lm_head.weight
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden.shape[0], self.chunk):
            piece = slice(start, start + self.chunk)
            total = total + checkpoint(
                self._chunk_loss, hidden[piece], weight, labels[piece], use_reentrant=False
            )
        return total / max(num_targets, 1)


def set_mode(lm: torch.nn.Module, mode: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        disable = getattr(lm, "activation_checkpointing_disable", None) or lm.gradient_checkpointing_disable
        disable()
        if mode == "recompute":
            kwargs = {"use_reentrant": False}
            if hasattr(lm, "activation_checkpointing_enable"):
                lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        elif mode == "remat":
            hf_distca.enable_remat_checkpointing(lm)


def max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def barrier(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()


def select_device(cpu: bool) -> tuple[torch.device, torch.dtype] | None:
    """(device, dtype) of this benchmark process: the CPU in float32 for a smoke test, else its local
    CUDA GPU (LOCAL_RANK) in bfloat16; None when there is no CUDA GPU."""
    if cpu:
        return torch.device("cpu"), torch.float32
    if not torch.cuda.is_available():
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank), torch.bfloat16


def build_model(name: str, layers: int, seed: int, device: torch.device, dtype: torch.dtype):
    """The recipe's built-in model ``name`` cut to ``layers`` decoder layers, random init from ``seed``,
    with the ``distca`` attention, no KV cache."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = recipe_model_shape(name)
    shape["num_hidden_layers"] = layers
    shape.setdefault("vocab_size", VOCAB_DOCS)
    config = LlamaConfig(**shape, tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(device):
        lm = AutoModelForCausalLM.from_config(config, attn_implementation="distca", dtype=dtype)
    lm.config.use_cache = False
    return lm


def build_batches(
    sample: list[int],
    tokens_per_rank: int,
    count: int,
    *,
    rank: int,
    world: int,
    seed: int,
    layout: LayoutFn,
    device: torch.device,
) -> list[dict]:
    """This rank's first ``count`` micro-batches of documents drawn (seeded) from the length ``sample``,
    placed on the ranks by ``layout`` (hf_distca.data.baselines.LAYOUTS), moved to ``device``."""
    rng = np.random.default_rng(seed)
    wanted = count * tokens_per_rank * world * 3
    lengths: list[int] = []
    while sum(lengths) < wanted:
        lengths += rng.choice(np.asarray(sample), size=256).tolist()
    docs = documents_with_lengths(lengths, vocab_size=VOCAB_DOCS, seed=seed)
    source = DistCABatches(
        docs, rank=rank, world_size=world, tokens_per_rank=tokens_per_rank, seed=seed, layout=layout
    )
    batches = []
    for batch in source:
        batches.append(
            {
                "input_ids": batch["input_ids"].to(device),
                "position_ids": batch["position_ids"].to(device),
                "shift_labels": batch["shift_labels"].to(device),
                "distca_layout": batch["distca_layout"],
                "num_targets": int(batch["shift_labels"].ne(-100).sum()),
            }
        )
        if len(batches) == count:
            break
    return batches


def timed_steps(step, batches, warmup: int, device: torch.device) -> dict:
    """Run ``step(batch)`` on every batch; after ``warmup`` of them: median step time (slowest rank),
    peak memory, forward kernel runs and bytes sent per step (max over ranks), planned imbalance."""
    times, kernels, sent, imbalance = [], [], [], []
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    for i, batch in enumerate(batches):
        if i == warmup and cuda:
            torch.cuda.reset_peak_memory_stats()
        barrier(device)
        metrics.reset()
        start = time.perf_counter()
        step(batch)
        barrier(device)
        elapsed = time.perf_counter() - start
        stats = metrics.snapshot()
        if i >= warmup:
            times.append(elapsed)
            kernels.append(stats.attn_fwd_kernels)
            sent.append(stats.bytes_sent)
            imbalance.append((stats.imbalance_before, stats.imbalance_after))
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    step_times = [max_over_ranks([t], device)[0] for t in times]
    peak_max, kernels_max, sent_max = max_over_ranks([peak, float(max(kernels)), float(max(sent))], device)
    return {
        "step_s": statistics.median(step_times),
        "steps": step_times,
        "peak_gib": peak_max,
        "kernels": int(kernels_max),
        "sent_gib": sent_max / 2**30,
        "imbalance": imbalance[0],
    }


def run_mode(model, lm, opt, batches, mode: str, warmup: int) -> dict:
    set_mode(lm, mode)
    lm.train()

    def step(batch: dict) -> None:
        loss = model(**batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timed_steps(step, batches, warmup, DEVICE)


def attention_forward_seconds(
    batches, layers: int, heads: int, kv_heads: int, head_dim: int, group, backend: str
) -> float:
    """Median over batches of the core-attention forward of all layers (dispatch, kernel, return)."""
    times = []
    config = DistCAConfig(backend=backend)
    for batch in batches:
        tokens = batch["input_ids"].shape[1]
        q = torch.randn(tokens, heads, head_dim, device=DEVICE, dtype=DTYPE)
        kv = torch.randn(tokens, kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
        layout = batch["distca_layout"]
        with torch.no_grad():
            core_attention(q, kv, kv, layout.pieces, group=group, config=config, all_pieces=layout.all_pieces)
            barrier(DEVICE)
            start = time.perf_counter()
            for _ in range(layers):
                core_attention(
                    q, kv, kv, layout.pieces, group=group, config=config, all_pieces=layout.all_pieces
                )
            barrier(DEVICE)
        times.append(max_over_ranks([time.perf_counter() - start], DEVICE)[0])
    return statistics.median(times)


def long_share(batches, threshold: int = 16384) -> float:
    """Share of the batches' tokens in documents of >= threshold tokens (padding counts as short)."""
    long_tokens = total = 0
    for batch in batches:
        lengths: dict[int, int] = {}
        for rank_pieces in batch["distca_layout"].all_pieces:
            for doc, start, n in rank_pieces:
                lengths[doc] = max(lengths.get(doc, 0), start + n)
        total += sum(lengths.values())
        long_tokens += sum(n for n in lengths.values() if n >= threshold)
    return long_tokens / max(total, 1)


def build_parser() -> argparse.ArgumentParser:
    """bench_remat's options (also read by check_simulator.py from a results table's command)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-8b-shaped", help="a built-in model of the recipe")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens-per-rank", type=int, default=65536)
    p.add_argument(
        "--doc-lengths", action="append", default=None, help="'mix' or [name=]path.json (repeatable)"
    )
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    p.add_argument(
        "--backends",
        default="auto",
        help="comma-separated kernel backends (DistCAConfig.backend); with several, every mode runs with each "
        "and is labelled 'mode (backend)'",
    )
    p.add_argument("--skip-none-for", default="", help="comma-separated sample names where 'none' is not run")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--loss-chunk", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--layout",
        choices=sorted(LAYOUTS),
        default="distca",
        help="how documents are placed on the ranks (the recipe's --layout; tokens: the token-only rebatcher)",
    )
    p.add_argument(
        "--out", default=None, help="markdown file for the table, rewritten after every mode (rank 0)"
    )
    p.add_argument("--json", default=None, help="JSON file for the raw results (rank 0)")
    p.add_argument(
        "--cpu", action="store_true", help="smoke test on the CPU (gloo, float32; no memory figures)"
    )
    return p


def main() -> int:
    p = build_parser()
    args = p.parse_args()
    global DEVICE, DTYPE
    selected = select_device(args.cpu)
    if selected is None:
        print("bench_remat.py needs CUDA GPUs (or --cpu for a smoke test)", file=sys.stderr)
        return 2
    DEVICE, DTYPE = selected
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        backend = "gloo" if args.cpu else "nccl"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=180))
    rank = dist.get_rank() if dist.is_initialized() else 0
    group = dist.group.WORLD if dist.is_initialized() else None

    lm = build_model(args.model, args.layers, args.seed, DEVICE, DTYPE)
    config = lm.config
    backends = [b for b in args.backends.split(",") if b]
    model = LossModel(lm, args.loss_chunk)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=None if args.cpu else [local_rank], gradient_as_bucket_view=True
        )
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    modes = [m for m in args.modes.split(",") if m]
    skip_none = {s for s in args.skip_none_for.split(",") if s}
    samples = [load_lengths(s, args.seed) for s in (args.doc_lengths or ["mix"])]
    head_dim = config.hidden_size // config.num_attention_heads
    results = {}
    for name, sample in samples:
        batches = build_batches(
            sample,
            args.tokens_per_rank,
            args.warmup + args.steps,
            rank=rank,
            world=world,
            seed=args.seed,
            layout=LAYOUTS[args.layout],
            device=DEVICE,
        )
        results[name] = {"long_share": long_share(batches), "modes": {}}
        for backend in backends:
            enable_distca(lm, group=group, config=DistCAConfig(backend=backend))
            for mode in modes:
                key = mode if len(backends) == 1 else f"{mode} ({backend})"
                if mode == "none" and name in skip_none:
                    results[name]["modes"][key] = {"skipped": True}
                    continue
                try:
                    results[name]["modes"][key] = run_mode(model, lm, opt, batches, mode, args.warmup)
                except torch.cuda.OutOfMemoryError:
                    if world > 1:
                        raise  # the other ranks may be inside a collective: stop the job
                    results[name]["modes"][key] = {"oom": True}
                if results[name]["modes"][key].get("oom"):  # outside the handler: its traceback is gone
                    opt.zero_grad(set_to_none=True)
                    torch.cuda.empty_cache()
                if rank == 0:
                    print(name, key, results[name]["modes"][key], flush=True)
                    write_outputs(
                        results, args, world, config
                    )  # after every mode: a later failure keeps these
        set_mode(lm, "none")
        lm.eval()
        results[name]["attn_fwd_s"] = attention_forward_seconds(
            batches[args.warmup :],
            args.layers,
            config.num_attention_heads,
            config.num_key_value_heads,
            head_dim,
            group,
            backends[0],
        )
    if rank == 0:
        print(write_outputs(results, args, world, config), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def write_outputs(results: dict, args, world: int, config, render=None) -> str:
    """(Re)write the markdown table (``render``, default this script's :func:`report`) and the JSON of the
    results so far to ``args.out`` / ``args.json``; return the table."""
    text = (render or report)(results, args, world, config)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return text


def report(results: dict, args, world: int, config) -> str:
    cmd = " ".join(["torchrun", f"--nproc-per-node {world}", shlex.join(sys.argv)])  # empty values quoted
    device = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "CPU (smoke test)"
    lines = [
        f"## Checkpointing modes, {world} x {device}, {args.model} ({args.layers} layers)",
        "",
        f"Command: `NCCL_NVLS_ENABLE=0 {cmd}`",
        "",
        f"torch {torch.__version__}, {DTYPE}, {args.tokens_per_rank} tokens per rank, hidden {config.hidden_size}, "
        f"{config.num_attention_heads}/{config.num_key_value_heads} heads, vocabulary {config.vocab_size}; "
        f"{'DDP' if world > 1 else 'one process'}; SGD; loss in chunks of {args.loss_chunk} tokens; median of {args.steps} steps after "
        f"{args.warmup} warm-up (same micro-batches in every mode). Peak: max over ranks of "
        "torch.cuda.max_memory_allocated.",
        "",
        "| sample (tokens in docs >= 16K) | mode | step time (s) | speed-up vs recompute (else vs first row) | peak memory (GiB) | "
        "attn fwd kernels / step | core-attn bytes sent / step (GiB) | imbalance before -> after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, res in results.items():
        first = next(iter(res["modes"].values()), {}).get("step_s")
        for mode, r in res["modes"].items():
            suffix = mode[mode.index(" (") :] if " (" in mode else ""
            # vs plain recompute with the same backend; without a recompute run, vs the first row
            base = res["modes"].get("recompute" + suffix, {}).get("step_s") or first
            label = f"{name} ({100 * res['long_share']:.0f}%)"
            if r.get("oom") or r.get("skipped"):
                why = "out of memory" if r.get("oom") else "not run (out of memory on 1 GPU)"
                lines.append(f"| {label} | {mode} | {why} | | | | | |")
                continue
            speed = f"{base / r['step_s']:.2f}x" if base else ""
            lines.append(
                f"| {label} | {mode} | {r['step_s']:.3f} | {speed} | {r['peak_gib']:.1f} | {r['kernels']} | "
                f"{r['sent_gib']:.2f} | {r['imbalance'][0]:.2f} -> {r['imbalance'][1]:.2f} |"
            )
        base = res["modes"].get("recompute", {}).get("step_s")
        if "attn_fwd_s" in res and "step_s" in res["modes"].get("remat", {}) and base:
            saved = res["modes"]["recompute"]["step_s"] - res["modes"]["remat"]["step_s"]
            lines.append(
                f"| {name} | core-attention forward alone, all layers | {res['attn_fwd_s']:.3f} | "
                f"recompute - remat = {saved:.3f} s | | | | |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
