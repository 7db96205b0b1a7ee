"""Step time with ping-pong vs without overlap vs free communication, and where the messages are hidden.

Run with torchrun on 2 or more GPUs (on one, nothing is exchanged: it measures what each schedule costs
by itself; one link per run: pass ``--link`` to label it, e.g. run once as is
over NVLink and once with ``NCCL_P2P_DISABLE=1``, which routes the all-to-all through host memory at
about one inter-node NIC's bandwidth). One model (the recipe's ``llama3-8b-shaped`` with ``--layers``
layers, bf16, attn_implementation="distca", DDP, rematerialization-aware checkpointing by default) and,
for every length sample and every ``--tokens-per-rank``, the same micro-batches trained in each mode:

- ``ping_pong``: DistCAConfig(ping_pong=True) with its default split (``local_first``: the work that
  needs no exchange in two halves around the work that does, whose exchanges fly during them), forward
  and backward;
- ``ping_pong_halves``: ping_pong_split="halves": two nano-batches of equal work, each with its own
  exchanges (the DistCA paper's ping and pong);
- ``serial``: ping_pong=False: dispatch, kernel, return one after the other;
- ``serial_tight``: serial with each micro-batch laid out at the fewest tokens per rank that hold it
  (``DistCABatches(pad_to_budget=False)``, as layer_ping_pong's nano-batches are) instead of padded to
  ``--tokens-per-rank``: what dropping the padding saves without the split;
- ``signal``: serial with every core-attention exchange replaced by 1-byte messages
  (benchmarks/signal_only.py): the same schedule, synchronisation and kernels with (almost) free
  communication; the step time ping-pong aims at;
- ``signal_pp``: ping-pong with 1-byte messages (what splitting the kernels in two costs by itself);
- ``layer_ping_pong``: DistCAConfig(layer_ping_pong=True): each micro-batch's documents in two nano-batches
  whose forwards interleave (hf_distca.forward_nano_batches), exchanges hidden behind the other
  nano-batch's projections, MLP and kernels; ``signal_layers``: the same with 1-byte messages (what
  splitting the micro-batch costs by itself);
- ``unbalanced``: the exact computation without balancing (max_planner_moves=0), ping-pong on (it still
  exchanges the KV of documents cut over ranks).

Core-attention exchanges run on their own process group (``--attn-group dedicated``, the default), so
DDP's gradient all-reduce does not queue behind them on one NCCL stream. Reported per mode: median step
time (slowest rank) over ``--steps`` steps after ``--warmup``, ratios to ``serial`` and ``signal``, peak
memory, core-attention bytes sent and kernel runs per step. ``--passes 2`` times the same micro-batches
again right after (no warm-up): every shape has then been seen once, so the second pass is the steady
state of a long run, where the shapes (bucketed by the cudnn kernel's plan cache) recur; the cuDNN plans
built during each pass are counted. Then one step of each ``--profile`` mode runs
under torch.profiler: the trace (rank 0) is written to ``--trace-dir`` and summarised per engine call
(one per layer and pass): its communication kernels' time, how much of it overlapped compute kernels
(hidden) and how much did not (exposed), and its server kernels' time.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 -m benchmarks.bench_ping_pong --layers 8 \\
        --tokens-per-rank 32768,65536 --doc-lengths mix --doc-lengths prolong=doclens_prolong.json \\
        --link nvlink --out ping_pong.md --json ping_pong.json --trace-dir traces

``--cpu`` is a smoke test (gloo, float32, tiny sizes; the summary then reads the stages' CPU ranges).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import shlex
import sys

import torch
import torch.distributed as dist

from hf_distca import DistCAConfig, enable_distca, forward_nano_batches
from hf_distca.data.baselines import LAYOUTS
from hf_distca.data.nano import NANO_BATCHES

from .common import (
    LossModel,
    add_model_arguments,
    add_step_arguments,
    barrier,
    build_model,
    init_process_group,
    load_lengths,
    long_share,
    select_device,
    set_mode,
    step_batches,
    timed_steps,
)
from .common import write_outputs as write_results
from .signal_only import signal_only
from .trace_summary import summarize_trace

MODES = (
    "ping_pong", "ping_pong_halves", "layer_ping_pong", "serial", "serial_tight", "signal", "signal_pp",
    "signal_layers", "unbalanced",
)  # fmt: skip
MODE_CONFIG = {
    "ping_pong": {"ping_pong": True},
    "ping_pong_halves": {"ping_pong": True, "ping_pong_split": "halves"},
    "serial": {"ping_pong": False},
    "serial_tight": {"ping_pong": False},
    "signal": {"ping_pong": False},
    "signal_pp": {"ping_pong": True},
    "layer_ping_pong": {"ping_pong": False, "layer_ping_pong": True},
    "signal_layers": {"ping_pong": False, "layer_ping_pong": True},
    "unbalanced": {"ping_pong": True, "max_planner_moves": 0},
}
SIGNAL_ONLY = {"signal", "signal_pp", "signal_layers"}
DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16


def one_step(model, opt, batch: dict, mode: str) -> None:
    with signal_only() if mode in SIGNAL_ONLY else contextlib.nullcontext():
        loss = sum(forward_nano_batches(model, lambda inputs: model(**inputs), batch))
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


PADDED = {"serial", "signal", "unbalanced", "ping_pong", "ping_pong_halves", "signal_pp"}
"""Modes whose micro-batches are padded to ``--tokens-per-rank`` (``DistCAConfig(pad_to_budget=True)``, the
rule of the earlier measurements); the others are laid out at the fewest tokens per rank that hold them,
as the library's default: ``serial_tight``, and the layer-level modes' nano-batches (always) and their
micro-batches that cannot split."""


def _nano_batches(mode: str) -> int:
    return 2 if MODE_CONFIG[mode].get("layer_ping_pong") else 1


def batch_kind(mode: str) -> tuple[int, bool]:
    """(nano-batches per micro-batch, padded to the budget) of the micro-batches ``mode`` trains."""
    return _nano_batches(mode), mode in PADDED


def _plans_built() -> int:
    """cuDNN plans built so far in this process, both directions (0 without the cudnn kernel)."""
    try:
        from hf_distca.kernels.cudnn_frontend import plan_builds
    except ImportError:
        return 0
    return sum(plan_builds.values())


def run_mode(model, opt, batches: list[dict], mode: str, warmup: int, passes: int = 1) -> dict:
    """:func:`timed_steps` of ``mode`` over ``batches``; ``passes`` > 1 times the same batches again (no
    warm-up), each pass's median under ``passes`` and the cuDNN plans it built under ``plans_built``;
    ``tokens_per_step``: this rank's tokens per micro-batch (padding included), mean over ``batches``."""
    out, medians, built = None, [], []
    for k in range(passes):
        before = _plans_built()
        # later passes: the first pass's timed micro-batches again (its warm-up ones are not timed)
        r = timed_steps(
            lambda batch: one_step(model, opt, batch, mode), batches if k == 0 else batches[warmup:],
            warmup if k == 0 else 0, DEVICE,
        )  # fmt: skip
        built.append(_plans_built() - before)
        medians.append(r["step_s"])
        out = out or r
    tokens = sum(int(n["input_ids"].shape[1]) for b in batches for n in b.get(NANO_BATCHES, (b,)))
    return {**out, "passes": medians, "plans_built": built, "tokens_per_step": tokens / len(batches)}


def profile_step(model, opt, batch: dict, mode: str, trace_path: str | None, rank: int) -> dict:
    """One step under torch.profiler; rank 0 writes the trace (gzip) and returns its summary."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if DEVICE.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    barrier(DEVICE)
    with torch.profiler.profile(activities=activities) as prof:
        one_step(model, opt, batch, mode)
        barrier(DEVICE)
    if rank != 0:
        return {}
    raw = (trace_path or "trace") + ".json"
    prof.export_chrome_trace(raw)
    with open(raw) as f:
        trace = json.load(f)
    if trace_path:
        with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
            dst.write(src.read())
    os.remove(raw)
    return summarize_trace(trace)


# ------------------------------------------------------------------------------------------ the run
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p, MODES)
    p.add_argument("--tokens-per-rank", default="32768,65536", help="comma-separated sizes")
    p.add_argument(
        "--profile",
        default="ping_pong,ping_pong_halves,serial",
        help="modes profiled for the timeline ('': none)",
    )
    p.add_argument("--checkpointing", choices=("remat", "none"), default="remat")
    p.add_argument(
        "--passes",
        type=int,
        default=1,
        help="times each mode's micro-batches are timed (2: a warm second pass)",
    )
    p.add_argument("--attn-group", choices=("dedicated", "world"), default="dedicated")
    p.add_argument("--backend", default="auto", help="DistCAConfig.backend")
    p.add_argument(
        "--link", default="nvlink", help="label of the link in the report (e.g. nvlink, p2p-disabled)"
    )
    add_step_arguments(p)
    p.add_argument(
        "--layout",
        choices=sorted(LAYOUTS),
        default="distca",
        help="how documents are placed (the recipe's --layout)",
    )
    p.add_argument("--out", default=None, help="markdown report, rewritten after every mode (rank 0)")
    p.add_argument("--json", default=None, help="raw results (rank 0)")
    p.add_argument("--trace-dir", default=None, help="where rank 0 writes the profiled steps' traces (gzip)")
    p.add_argument("--cpu", action="store_true", help="smoke test on the CPU (gloo, float32)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    global DEVICE, DTYPE
    selected = select_device(args.cpu)
    if selected is None:
        print("bench_ping_pong.py needs CUDA GPUs (or --cpu for a smoke test)", file=sys.stderr)
        return 2
    DEVICE, DTYPE = selected
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    init_process_group("gloo" if args.cpu else "nccl", timeout_s=300)
    rank = dist.get_rank()
    group = dist.new_group(list(range(world))) if args.attn_group == "dedicated" else dist.group.WORLD

    lm = build_model(args.model, args.layers, args.seed, DEVICE, DTYPE)
    config = lm.config
    set_mode(lm, "remat" if args.checkpointing == "remat" else "none")
    lm.train()
    model = torch.nn.parallel.DistributedDataParallel(
        LossModel(lm, args.loss_chunk),
        device_ids=None if args.cpu else [local_rank],
        gradient_as_bucket_view=True,
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    profiled = [m for m in args.profile.split(",") if m and m in modes]
    if args.trace_dir and rank == 0:
        os.makedirs(args.trace_dir, exist_ok=True)
    sizes = [int(x) for x in args.tokens_per_rank.split(",") if x]
    samples = [load_lengths(s, args.seed) for s in (args.doc_lengths or ["mix"])]
    results: dict = {}
    for name, sample in samples:
        for tokens in sizes:
            key = f"{name} / {tokens // 1024}K" if tokens >= 1024 else f"{name} / {tokens}"
            batches = {  # by batch_kind: the same documents and micro-batches in every mode
                kind: step_batches(
                    sample,
                    tokens,
                    args,
                    rank=rank,
                    world=world,
                    device=DEVICE,
                    nano_batches=kind[0],
                    pad_to_budget=kind[1],
                )  # fmt: skip
                for kind in sorted({batch_kind(m) for m in modes} | {(1, True)})
            }
            res = results[key] = {
                "long_share": long_share(batches[(1, True)]),
                "tokens": tokens,
                "modes": {},
                "timeline": {},
            }
            for mode in modes:
                cfg = DistCAConfig(backend=args.backend, **MODE_CONFIG[mode])
                enable_distca(lm, group=group, config=cfg)
                res["modes"][mode] = run_mode(
                    model, opt, batches[batch_kind(mode)], mode, args.warmup, args.passes
                )  # fmt: skip
                if rank == 0:
                    print(key, mode, res["modes"][mode], flush=True)
                    write_outputs(results, args, world, config)
            for mode in profiled:
                enable_distca(lm, group=group, config=DistCAConfig(backend=args.backend, **MODE_CONFIG[mode]))
                mode_batches = batches[batch_kind(mode)]
                one_step(model, opt, mode_batches[0], mode)  # warm: plans cached, allocator settled
                trace = None
                if args.trace_dir:
                    trace = os.path.join(
                        args.trace_dir, f"{name}_{tokens}_{mode}_{args.link}".replace("/", "_")
                    )
                res["timeline"][mode] = profile_step(model, opt, mode_batches[-1], mode, trace, rank)
            if rank == 0:
                write_outputs(results, args, world, config)
    if rank == 0:
        print(write_outputs(results, args, world, config), flush=True)
    dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------------------------- report
def write_outputs(results: dict, args, world: int, config) -> str:
    return write_results(results, args, world, config, render=report)


def _timeline_rows(calls: list[dict], layers: int) -> list[str]:
    rows = []
    for c in calls:
        label = f"{c['pass']} {c['call'] if c['pass'] == 'fwd' else layers - 1 - c['call']}"
        if "comm_ms" in c:
            share = 100 * c["hidden_ms"] / c["comm_ms"] if c["comm_ms"] else 100.0
            rows.append(
                f"| {label} | {c['comm_ms']:.2f} | {c['hidden_ms']:.2f} ({share:.0f}%) | {c['exposed_ms']:.2f} | "
                f"{c['server_ms']:.2f} | {' '.join(c['stages'])} |"
            )
        else:
            rows.append(
                f"| {label} | {c['wait_ms']:.2f} (CPU, blocked) | | | {c['server_ms']:.2f} | {' '.join(c['stages'])} |"
            )
    return rows


def report(results: dict, args, world: int, config) -> str:
    cmd = " ".join(
        [
            "torchrun",
            f"--nproc-per-node {world}",
            shlex.join(["-m", "benchmarks.bench_ping_pong", *sys.argv[1:]]),
        ]
    )  # empty values quoted
    device = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "CPU (smoke test)"
    env = []
    if DEVICE.type == "cuda":
        p2p = os.environ.get("NCCL_P2P_DISABLE")
        env = ["NCCL_NVLS_ENABLE=0"] + ([f"NCCL_P2P_DISABLE={p2p}"] if p2p is not None else [])
    lines = [
        f"## Ping-pong, {world} x {device}, link: {args.link}, {args.model} ({args.layers} layers)",
        "",
        *(
            [
                "One process: nothing is exchanged, so these figures are what each schedule costs without "
                "communication (kernels split in two, nano-batches' half-size GEMMs, thread switches).",
                "",
            ]
            if world == 1
            else []
        ),  # fmt: skip
        f"Command: `{' '.join([*env, cmd])}`",
        "",
        f"torch {torch.__version__}, {DTYPE}, hidden {config.hidden_size}, {config.num_attention_heads}/"
        f"{config.num_key_value_heads} heads, vocabulary {config.vocab_size}; DDP; SGD; checkpointing: "
        f"{args.checkpointing}; attention exchanges on a {args.attn_group} process group; kernel backend "
        f"{args.backend}; median of {args.steps} steps after {args.warmup} warm-up, slowest rank (same "
        "micro-batches in every mode). `vs signal`: step time / signal-only step time (the goal: <= 1.05 for "
        "ping_pong).",
        "",
        "| sample / tokens per rank (tokens in docs >= 16K) | mode | step time (s) | vs serial | vs signal | "
        "peak memory (GiB) | attn fwd kernels / step | core-attn bytes sent / step (GiB) | imbalance before -> after |"
        + (
            " later passes: step time (s), vs serial | cuDNN plans built per pass |"
            if args.passes > 1
            else ""
        ),
        "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if args.passes > 1 else ""),
    ]
    for key, res in results.items():
        serial = res["modes"].get("serial", {}).get("step_s")
        signal = res["modes"].get("signal", {}).get("step_s")
        for mode, r in res["modes"].items():
            vs_serial = f"{serial / r['step_s']:.2f}x faster" if serial else ""
            vs_signal = f"{r['step_s'] / signal:.3f}" if signal else ""
            row = (
                f"| {key} ({100 * res['long_share']:.0f}%) | {mode} | {r['step_s']:.3f} | {vs_serial} | {vs_signal} | "
                f"{r['peak_gib']:.1f} | {r['kernels']} | {r['sent_gib']:.3f} | "
                f"{r['imbalance'][0]:.2f} -> {r['imbalance'][1]:.2f} |"
            )
            if args.passes > 1:
                later = res["modes"].get("serial", {}).get("passes", [])
                row += " " + ", ".join(
                    f"{t:.3f}" + (f" ({later[k] / t:.2f}x)" if k < len(later) else "")
                    for k, t in enumerate(r["passes"]) if k > 0
                ) + f" | {' / '.join(str(n) for n in r['plans_built'])} |"  # fmt: skip
            lines.append(row)
    for key, res in results.items():
        for mode, summary in res.get("timeline", {}).items():
            calls = summary.get("calls")
            if not calls:
                continue
            lines += [
                "",
                f"### Timeline: {key}, {mode} (one profiled step, rank 0, per layer and pass)",
                "",
                "| layer | comm kernels (ms) | hidden behind compute (ms) | exposed (ms) | server kernels (ms) | "
                "stages in start order |",
                "|---|---|---|---|---|---|",
                *_timeline_rows(calls, args.layers),
            ]
            if "comm_ms" in calls[0]:
                comm = sum(c["comm_ms"] for c in calls)
                hidden = sum(c["hidden_ms"] for c in calls)
                lines.append(
                    f"| all | {comm:.1f} | {hidden:.1f} ({100 * hidden / comm if comm else 100:.0f}%) | "
                    f"{comm - hidden:.1f} | {sum(c['server_ms'] for c in calls):.1f} | |"
                )
                idle = summary["span_ms"] - summary["compute_busy_ms"]
                lines += ["", f"Step: kernels from first to last {summary['span_ms']:.1f} ms, compute idle {idle:.1f} ms. "
                          "NCCL kernels (all of them, DDP's too): " + "; ".join(
                              f"{name} {v['ms']:.1f} ms ({100 * v['hidden_ms'] / v['ms'] if v['ms'] else 100:.0f}% hidden)"
                              for name, v in summary["nccl"].items()) + "."]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
