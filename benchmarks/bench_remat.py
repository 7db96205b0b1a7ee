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

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 -m benchmarks.bench_remat --layers 8 \\
        --doc-lengths mix --doc-lengths prolong=data/doclens_prolong.json --out results.md
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time

import torch
import torch.distributed as dist

from hf_distca import DistCAConfig, core_attention, enable_distca
from hf_distca.data.baselines import LAYOUTS
from hf_distca.engine import probe

from . import common

MODES = ("remat", "recompute", "none")
DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16


def attention_forward_seconds(
    batches, layers: int, heads: int, kv_heads: int, head_dim: int, group, backend: str
) -> float:
    """Median over batches of the core-attention forward of all layers (dispatch, kernel, return)."""
    times = []
    config = DistCAConfig(backend=backend)
    probe(
        config,
        group=group,
        device=DEVICE,
        dtypes=[DTYPE],
        q_heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
    )
    for batch in batches:
        tokens = batch["input_ids"].shape[1]
        q = torch.randn(tokens, heads, head_dim, device=DEVICE, dtype=DTYPE)
        kv = torch.randn(tokens, kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
        layout = batch["distca_layout"]
        with torch.no_grad():
            core_attention(q, kv, kv, layout.pieces, group=group, config=config, all_pieces=layout.all_pieces)
            common.barrier(DEVICE)
            start = time.perf_counter()
            for _ in range(layers):
                core_attention(
                    q, kv, kv, layout.pieces, group=group, config=config, all_pieces=layout.all_pieces
                )
            common.barrier(DEVICE)
        times.append(common.max_over_ranks([time.perf_counter() - start], DEVICE)[0])
    return statistics.median(times)


def build_parser() -> argparse.ArgumentParser:
    """bench_remat's options (also read by check_simulator.py from a results table's command)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_arguments(p, MODES)
    p.add_argument("--tokens-per-rank", type=int, default=65536)
    p.add_argument(
        "--backends",
        default="auto",
        help="comma-separated kernel backends (DistCAConfig.backend); with several, every mode runs with each "
        "and is labelled 'mode (backend)'",
    )
    p.add_argument("--skip-none-for", default="", help="comma-separated sample names where 'none' is not run")
    common.add_step_arguments(p)
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
    selected = common.select_device(args.cpu)
    if selected is None:
        print("bench_remat.py needs CUDA GPUs (or --cpu for a smoke test)", file=sys.stderr)
        return 2
    DEVICE, DTYPE = selected
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    rank, world, group = common.init_distributed(args.cpu, timeout_s=180)

    lm = common.build_model(args.model, args.layers, args.seed, DEVICE, DTYPE)
    config = lm.config
    backends = [b for b in args.backends.split(",") if b]
    model = common.LossModel(lm, args.loss_chunk)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=None if args.cpu else [local_rank], gradient_as_bucket_view=True
        )
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    modes = [m for m in args.modes.split(",") if m]
    skip_none = {s for s in args.skip_none_for.split(",") if s}
    samples = [common.load_lengths(s, args.seed) for s in (args.doc_lengths or ["mix"])]
    head_dim = config.hidden_size // config.num_attention_heads
    results = {}
    for name, sample in samples:
        batches = common.step_batches(
            sample, args.tokens_per_rank, args, rank=rank, world=world, device=DEVICE
        )
        results[name] = {"long_share": common.long_share(batches), "modes": {}}
        for backend in backends:
            enable_distca(lm, group=group, config=DistCAConfig(backend=backend))
            for mode in modes:
                key = mode if len(backends) == 1 else f"{mode} ({backend})"
                if mode == "none" and name in skip_none:
                    results[name]["modes"][key] = {"skipped": True}
                    continue
                try:
                    results[name]["modes"][key] = common.run_mode(
                        model, lm, opt, batches, mode, args.warmup, DEVICE
                    )
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
        common.set_mode(lm, "none")
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


def write_outputs(results: dict, args, world: int, config) -> str:
    """common.write_outputs with this script's :func:`report`."""
    return common.write_outputs(results, args, world, config, render=report)


def report(results: dict, args, world: int, config) -> str:
    cmd = " ".join(
        ["torchrun", f"--nproc-per-node {world}", shlex.join(["-m", "benchmarks.bench_remat", *sys.argv[1:]])]
    )  # empty values quoted
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
