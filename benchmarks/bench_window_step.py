"""Training-step time of a Gemma-3-shaped model (5 sliding-window layers to 1 global) at long context.

Run with torchrun on 1 or more GPUs. One model (the recipe's ``gemma3-4b-shaped`` cut to ``--layers``
layers, bf16, random init, DDP-free: every rank its own copy, gradients not reduced, as in
bench_remat.py) and the same documents (bench_remat's ``mix`` or a length file, ``--tokens-per-rank``
tokens per rank, the DistCA layout) trained with each mode:

- ``distca``: attn_implementation="distca" over all ranks: every local layer attends within its window
  (W = the config's ``sliding_window``), every global layer over the whole document, documents cut over
  ranks exactly (the CA-tasks of local layers carry only their window's keys);
- ``cut-to-window``: every document cut into independent chunks of W tokens (position ids restart at
  every chunk), run by distca's local kernels on each rank: what a user gets by keeping documents at most
  one window long; the global layers then see only W tokens too (another model, the math differs);
- ``sdpa``: Transformers' SDPA on each rank's packed tokens (its sliding-window and document masks
  built from the position ids; pieces of documents cut over ranks attend only locally).

A step is forward + backward (common.LossModel: chunked cross-entropy) + SGD update, with
rematerialization-aware checkpointing for distca and cut-to-window and Transformers' activation
checkpointing for sdpa (``--checkpointing none`` turns both off). Reported: median step time (slowest
rank) after ``--warmup``, peak memory, tokens per second; a mode that fails (e.g. SDPA's 64K x 64K masks
out of memory) is reported as its error.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 1 -m benchmarks.bench_window_step --layers 6 \\
        --tokens-per-rank 65536 --out benchmarks/results/window_step_h200.md
    python -m benchmarks.bench_window_step --cpu   # smoke test: tiny-gemma3 on the CPU
"""

from __future__ import annotations

import argparse
import shlex
import sys
import traceback

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import hf_distca
from hf_distca import DistCAConfig, enable_distca
from hf_distca.data.baselines import LAYOUTS

from . import common

MODES = ("distca", "cut-to-window", "sdpa")


def recipe_config(name: str, layers: int, vocab: int):
    """The recipe's built-in config ``name`` with ``layers`` decoder layers (layer types re-derived)."""
    recipe = common.load_recipe()
    vocab = max(recipe.BUILTIN_MODELS[name].get("vocab_size", vocab), vocab)
    return recipe.builtin_config(name, num_hidden_layers=layers, vocab_size=vocab)


def cut_to_window(batch: dict, window: int) -> dict:
    """The batch with position ids restarting every ``window`` tokens of each document (chunks become
    independent documents) and no distca layout (local attention on each rank)."""
    pos = batch["position_ids"] % window  # (1, T): document positions -> positions in their chunk
    out = dict(batch, position_ids=pos, distca_layout=None)
    labels = batch["shift_labels"].clone()  # (1, T): the last token of a chunk predicts nothing
    nxt = torch.cat([pos[:, 1:], torch.zeros_like(pos[:, :1])], dim=1)
    labels[nxt == 0] = -100
    out["shift_labels"] = labels
    out["num_targets"] = int(labels.ne(-100).sum())
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma3-4b-shaped", help="a built-in model of the recipe")
    p.add_argument("--layers", type=int, default=6, help="decoder layers (6: 5 local + 1 global)")
    p.add_argument("--tokens-per-rank", type=int, default=65536)
    p.add_argument("--doc-lengths", default="mix", help="'mix' or [name=]path.json")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    p.add_argument("--checkpointing", choices=("on", "none"), default="on")
    common.add_step_arguments(p)
    p.add_argument("--backend", default="auto", help="DistCAConfig.backend")
    p.add_argument("--out", default=None, help="markdown file for the table (rank 0)")
    p.add_argument(
        "--cpu", action="store_true", help="smoke test: tiny-gemma3, 1024 tokens, float32 on the CPU"
    )
    args = p.parse_args()
    if args.cpu:
        args.model, args.layers, args.tokens_per_rank = "tiny-gemma3", 3, min(args.tokens_per_rank, 1024)
        args.warmup, args.steps, args.loss_chunk = 0, 1, 512
    selected = common.select_device(args.cpu)
    if selected is None:
        print("bench_window_step.py needs CUDA GPUs (or --cpu for a smoke test)", file=sys.stderr)
        return 2
    device, dtype = selected
    rank, world, group = common.init_distributed(args.cpu)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    config = recipe_config(args.model, args.layers, common.VOCAB_DOCS)
    window = config.sliding_window
    windows = hf_distca.features.layer_windows(config)
    name, sample = common.load_lengths(args.doc_lengths, args.seed)
    batches = common.build_batches(
        sample, args.tokens_per_rank, args.warmup + args.steps, rank=rank, world=world, seed=args.seed,
        layout=LAYOUTS["distca"], device=device,
    )  # fmt: skip
    results: dict[str, dict | str] = {}
    for mode in modes:
        try:
            torch.manual_seed(args.seed)
            attn = "sdpa" if mode == "sdpa" else "distca"
            with torch.device(device):
                lm = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
            lm.config.use_cache = False
            if attn == "distca":  # cut-to-window: the runtime only picks the kernel (no layout: local)
                enable_distca(lm, group=group, config=DistCAConfig(backend=args.backend))
            model = common.LossModel(lm, args.loss_chunk)
            opt = torch.optim.SGD(lm.parameters(), lr=1e-6)
            check = "none" if args.checkpointing == "none" else ("recompute" if mode == "sdpa" else "remat")
            runs = batches if mode == "distca" else [cut_to_window(b, window) for b in batches]
            if mode == "sdpa":
                runs = [dict(b, distca_layout=None) for b in batches]
            results[mode] = common.run_mode(model, lm, opt, runs, check, args.warmup, device)
            del lm, model, opt
        except Exception as err:  # one failing mode (out of memory) must not hide the others
            traceback.print_exc()
            results[mode] = f"{type(err).__name__}: {str(err)[:160]}"
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        command = shlex.join(
            ["torchrun", f"--nproc-per-node={world}", "-m", "benchmarks.bench_window_step", *sys.argv[1:]]
        )
        local = sum(w is not None for w in windows)
        lines = [
            f"# Sliding-window training step: {args.model}, {args.layers} layers ({local} local of window "
            f"{window}, {args.layers - local} global)",
            "",
            f"- command: `{command}`",
            f"- {world} rank(s) on {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'the CPU'}, "
            f"{dtype}, {args.tokens_per_rank} tokens per rank, documents from '{name}', checkpointing "
            f"{args.checkpointing}; median of {args.steps} steps after {args.warmup}",
            "",
            "| mode | step s | tokens/s (all ranks) | peak GiB | core-attention GiB sent | vs distca |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        base = results.get("distca")
        for mode in modes:
            r = results[mode]
            if isinstance(r, str):
                lines.append(f"| {mode} | error: {r} |||||")
                continue
            tokens = args.tokens_per_rank * world / r["step_s"]
            vs = f"{r['step_s'] / base['step_s']:.2f}x" if isinstance(base, dict) else "-"
            lines.append(
                f"| {mode} | {r['step_s']:.3f} | {tokens:,.0f} | {r['peak_gib']:.1f} | {r['sent_gib']:.3f} | {vs} |"
            )
        text = "\n".join(lines) + "\n"
        common.write_report(text, args.out)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
