"""Step time with each decoder layer compiled (torch.compile, fullgraph) vs eager, DistCA attention inside.

Run with torchrun on 1 or more GPUs. The model and micro-batches are bench_remat.py's (the recipe's
``llama3-8b-shaped`` cut to ``--layers`` layers, bf16, ``distca`` attention, rematerialization-aware
checkpointing, chunked cross-entropy, SGD, DDP over the GPUs), trained with the same micro-batches:

- ``eager``: the model as Transformers builds it;
- ``compiled``: every decoder layer ``layer.compile(fullgraph=True)`` (Inductor): norms, projections,
  RoPE and MLP fused and tuned by the compiler, core attention inside as the engine's custom ops
  (hf_distca.engine.compiled); the checkpoint around each layer stays eager and keeps the attention
  outputs, so neither mode recomputes core attention.

Reported per mode: median step time (slowest rank) after ``--warmup`` steps (the compiled mode's first
step, which compiles, is timed on its own), the speed-up over eager, peak memory and each step's loss
(the two modes must agree within bf16 rounding).

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 1 -m benchmarks.bench_compile --layers 8 --out results.md
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

import torch
import torch.distributed as dist

from hf_distca import DistCAConfig, enable_distca
from hf_distca.data.baselines import LAYOUTS

from .common import (
    LossModel,
    add_step_arguments,
    build_model,
    init_distributed,
    load_lengths,
    select_device,
    set_mode,
    step_batches,
    timed_steps,
    write_outputs,
)

MODES = ("eager", "compiled")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3-8b-shaped", help="a built-in model of the recipe")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens-per-rank", type=int, default=65536)
    p.add_argument(
        "--doc-lengths", default="mix", help="mix, or NAME=lengths.json (bench_remat.py's samples)"
    )
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="distca")
    p.add_argument("--backend", default="auto", help="DistCAConfig.backend of the attention kernel")
    add_step_arguments(p, steps=4)
    p.add_argument(
        "--compile-backend", default="inductor", help="torch.compile backend (aot_eager on the CPU)"
    )
    p.add_argument("--cpu", action="store_true", help="a smoke test on the CPU (gloo), tiny sizes")
    p.add_argument("--out", default=None, help="markdown file for the table (rank 0)")
    p.add_argument("--json", default=None, help="JSON file for the raw results (rank 0)")
    return p


def run_mode(model, lm, opt, batches, warmup: int, device) -> dict:
    losses: list[float] = []

    def step(batch: dict) -> None:
        loss = model(**batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))

    lm.train()
    result = timed_steps(step, batches, warmup, device)
    return {**result, "losses": losses}


def main() -> int:
    args = build_parser().parse_args()
    selected = select_device(args.cpu)
    if selected is None:
        print("bench_compile.py needs CUDA GPUs (or --cpu for a smoke test)", file=sys.stderr)
        return 2
    device, dtype = selected
    rank, world, group = init_distributed(args.cpu)
    name, sample = load_lengths(args.doc_lengths, args.seed)
    batches = step_batches(sample, args.tokens_per_rank, args, rank=rank, world=world, device=device, extra=1)
    results: dict = {name: {"modes": {}}}
    for mode in MODES:
        lm = build_model(args.model, args.layers, args.seed, device, dtype)  # the same initial weights
        enable_distca(lm, group=group, config=DistCAConfig(backend=args.backend))
        set_mode(lm, "remat")
        model = LossModel(lm, args.loss_chunk)
        if world > 1:
            model = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=None if args.cpu else [device.index], gradient_as_bucket_view=True
            )
        opt = torch.optim.SGD(model.parameters(), lr=1e-6)
        first = 0.0
        if mode == "compiled":
            for layer in lm.model.layers:
                layer.compile(fullgraph=True, backend=args.compile_backend)
        start = time.perf_counter()
        first_loss = run_mode(model, lm, opt, batches[:1], 0, device)["losses"]  # compiles when compiled
        first = time.perf_counter() - start
        res = run_mode(model, lm, opt, batches[1:], args.warmup, device)
        res.update(first_step_s=first, losses=first_loss + res["losses"])
        results[name]["modes"][mode] = res
        if rank == 0:
            print(mode, res, flush=True)
        del model, lm, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        print(write_outputs(results, args, world, None, render=report), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def report(results: dict, args, world: int, _config) -> str:
    cmd = " ".join(
        [
            "torchrun",
            f"--nproc-per-node {world}",
            shlex.join(["-m", "benchmarks.bench_compile", *sys.argv[1:]]),
        ]
    )
    device = (
        torch.cuda.get_device_name() if torch.cuda.is_available() and not args.cpu else "CPU (smoke test)"
    )
    lines = [
        f"## torch.compile of each decoder layer vs eager, {world} x {device}, {args.model} ({args.layers} layers)",
        "",
        f"Command: `NCCL_NVLS_ENABLE=0 {cmd}`",
        "",
        f"torch {torch.__version__}, {args.tokens_per_rank} tokens per rank, kernel backend {args.backend}, "
        f"rematerialization-aware checkpointing, SGD, loss in chunks of {args.loss_chunk} tokens; median of "
        f"{args.steps} steps after {args.warmup} warm-up, the same micro-batches in both modes; the first step "
        "(compilation) timed apart.",
        "",
        "| sample | mode | step time (s) | speed-up vs eager | first step (s) | peak memory (GiB) | losses per step |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, res in results.items():
        eager = res["modes"].get("eager", {}).get("step_s")
        for mode, r in res["modes"].items():
            speed = f"{eager / r['step_s']:.3f}x" if eager else ""
            losses = ", ".join(f"{x:.4f}" for x in r["losses"])
            lines.append(
                f"| {name} | {mode} | {r['step_s']:.3f} | {speed} | {r['first_step_s']:.1f} | {r['peak_gib']:.1f} | "
                f"{losses} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
