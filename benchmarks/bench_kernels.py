"""Throughput and peak memory of the CUDA kernel backends on packed causal workloads (CUDA only).

Workloads (each ~64K packed tokens): equal documents of 512 / 2K / 8K / 64K tokens, a mixed set of 64 to
16K tokens, suffix tasks (1K queries over 2K keys x 32, 4K over 8K x 8: query shards at the end of a
longer KV prefix) and, with ``--doclens FILE``, the task mix one server runs in a real plan: documents
drawn from the file are rebatched over ``--servers`` ranks of 64K tokens, planned by the DistCA planner,
and the busiest server's CA-tasks form the call. Variants: ``torch_varlen`` (FlashAttention-2 varlen),
``cudnn:bottom_right`` (suffix tasks in one bottom-right call) and ``cudnn:split`` (suffix tasks split
into a non-causal and a top-left part, merged by the log-sum-exp). Every call goes through the explicit
interface (attention_forward, then attention_backward) with offsets on the host.

TFLOP/s use the causal convention: forward = 4 x Hq x D per visible (query, key) pair,
forward+backward = 3.5 x forward. Peak memory is the most allocated during one forward+backward
beyond the inputs (outputs, lse, gradients and workspaces included). Also measured: the cost of cuDNN
plan builds (first call, a new shape) and of rounding plan shapes up (``CudnnOptions.bucket_shapes``
off vs on).

    python -m benchmarks.bench_kernels --doclens prolong.json --out benchmarks/results/kernels.md

``--windows 1024 2048 4096 8192``: sliding-window kernels instead: one document of ``--tokens`` tokens
(64K) as full causal and under each window, every variant, forward and forward+backward TFLOP/s with the
pairs each window really computes (min(i + 1, W) per query: hf_distca.planning.window.attended_pairs),
and the time relative to full causal. ``--smoke`` runs that mode on the CPU with the reference kernel
and tiny sizes (a check that the script starts, not a measurement).

    python -m benchmarks.bench_kernels --windows 1024 2048 4096 8192 --out benchmarks/results/kernels_window_h200.md
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable

import torch

from hf_distca.planning.cost import FWD_BWD_FLOP_RATIO as FWD_BWD_FACTOR
from hf_distca.planning.cost import forward_flops_per_pair

from .common import median_ms, write_report

FWD_FLOPS_PER_PAIR = int(forward_flops_per_pair(1, 1))  # x Hq x D: QK^T and PV, 2 FLOPs per multiply-add each
VARIANTS = ("torch_varlen", "cudnn:bottom_right", "cudnn:split")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="markdown file to write the tables to (default: print only)")
    p.add_argument("--tokens", type=int, default=65536, help="packed tokens per call")
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads (GQA)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    p.add_argument("--doclens", nargs="*", default=[], help="JSON files of document lengths (server mixes)")
    p.add_argument("--servers", type=int, default=8, help="ranks the server mixes are planned over")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls before timing")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions; the median is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--windows",
        type=int,
        nargs="*",
        default=None,
        help="sliding-window mode: these windows on one document",
    )
    p.add_argument("--smoke", action="store_true", help="the windows mode on the CPU, reference kernel, tiny")
    args = p.parse_args(argv)
    if args.smoke:
        args.windows = args.windows or [64, 128]
        args.tokens, args.heads, args.kv_heads, args.head_dim = min(args.tokens, 512), 4, 2, 16
        args.warmup, args.reps = 0, 1
        args.variants = ["reference"]
        return args
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {VARIANTS}")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    return args


def visible_pairs(q_len: int, k_len: int, window: int | None = None) -> int:
    """(query, key) pairs a bottom-right causal sequence computes (under a sliding window: min(i + 1, W)
    per query, hf_distca.planning.window.attended_pairs)."""
    from hf_distca.planning.window import attended_pairs

    return attended_pairs(k_len - q_len, k_len, window)


def mixed_lengths(total: int, lo: int, hi: int, seed: int) -> list[int]:
    """Log-uniform document lengths in [lo, hi] filling exactly ``total`` tokens (the last one cut)."""
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while sum(out) < total:
        n = round(lo * math.exp(float(torch.rand(1, generator=g)) * math.log(hi / lo)))
        out.append(min(n, total - sum(out)))
    return out


def server_mix(
    doclens_path: str, servers: int, tokens_per_rank: int, seed: int
) -> tuple[list[int], list[int]]:
    """The CA-tasks (query lengths, key lengths) of the busiest server of one planned global batch."""
    import numpy as np

    from hf_distca import DistCAConfig, plan_core_attention
    from hf_distca.data.rebatch import layout_pieces

    with open(doclens_path) as f:
        doclens = np.asarray(json.load(f))
    rng = np.random.default_rng(seed)
    docs, used, budget = [], 0, servers * tokens_per_rank
    while used < budget:
        n = int(min(doclens[rng.integers(len(doclens))], budget - used))
        if n > 0:
            docs.append(n)
            used += n
    pieces = layout_pieces(docs, world_size=servers, tokens_per_rank=tokens_per_rank, min_piece_tokens=128)
    plan = plan_core_attention(
        [[tuple(p) for p in rank] for rank in pieces],
        q_row_bytes=32 * 128 * 2,
        kv_row_bytes=2 * 8 * 128 * 2,
        options=DistCAConfig().planner_options(),
    )
    busiest = max(range(servers), key=lambda s: plan.load_after[s])
    tasks = plan.tasks[busiest]
    return [t.q_len for t in tasks], [t.q_end for t in tasks]


def workloads(args: argparse.Namespace) -> list[tuple[str, list[int], list[int]]]:
    t = args.tokens
    rows = [
        (f"{n if n < 1024 else str(n // 1024) + 'K'} x {t // n}", [n] * (t // n), [n] * (t // n))
        for n in (512, 2048, 8192, 65536)
    ]
    mixed = mixed_lengths(t, 64, 16384, args.seed)
    rows.append((f"mixed 64-16K ({len(mixed)} docs)", mixed, mixed))
    rows.append(("suffix 1K over 2K x 32", [1024] * 32, [2048] * 32))
    rows.append(("suffix 4K over 8K x 8", [4096] * 8, [8192] * 8))
    # whole documents and suffix tasks interleaved: each alignment group has gaps between its rows
    rows.append(("2K docs + suffix 1K over 2K, x 16 each", [2048, 1024] * 16, [2048, 2048] * 16))
    for path in args.doclens:
        q_lens, k_lens = server_mix(path, args.servers, t, args.seed)
        suffix = sum(1 for a, b in zip(q_lens, k_lens) if a < b)
        name = os.path.splitext(os.path.basename(path))[0]
        rows.append((f"server mix {name} ({len(q_lens)} tasks, {suffix} suffix)", q_lens, k_lens))
    return rows


def variant_kwargs(variant: str, bucket_shapes: bool = True) -> dict:
    """attention_forward/attention_backward's keyword arguments that run ``variant`` ("cudnn:<strategy>":
    the cudnn backend with that suffix strategy; ``bucket_shapes`` applies to those only)."""
    from hf_distca.kernels import CudnnOptions

    backend, _, strategy = variant.partition(":")
    if not strategy:
        return {"backend": backend}
    return {"backend": backend, "cudnn_options": CudnnOptions(strategy, bucket_shapes=bucket_shapes)}


def make_inputs(q_lens, k_lens, args, seed=0):
    dev, dt = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(sum(q_lens), args.heads, args.head_dim, device=dev, generator=g).to(dt)  # (Tq, Hq, D)
    k = torch.randn(sum(k_lens), args.kv_heads, args.head_dim, device=dev, generator=g).to(dt)  # (Tk, Hkv, D)
    v = torch.randn(sum(k_lens), args.kv_heads, args.head_dim, device=dev, generator=g).to(dt)  # (Tk, Hkv, D)
    dout = torch.randn(q.shape, device=dev, generator=g).to(dt)  # (Tq, Hq, D)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)  # host (N + 1,)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, dout, (cu_q, cu_k, max(q_lens), max(k_lens))


def bench_one(variant: str, q_lens, k_lens, args, inputs, reference=None, bucket_shapes=True) -> dict:
    from hf_distca.kernels import attention_backward, attention_forward

    run = variant_kwargs(variant, bucket_shapes)
    q, k, v, dout, kargs = inputs

    def fwd() -> tuple[torch.Tensor, torch.Tensor]:
        return attention_forward(q, k, v, *kargs, **run)

    def fwd_bwd():
        out, lse = fwd()
        return out, lse, attention_backward(dout, q, k, v, out, lse, *kargs, **run)

    torch.cuda.synchronize()
    result = fwd_bwd()  # also builds plans
    torch.cuda.synchronize()
    errors = {}
    if reference is not None:
        got, want = (result[0], *result[2]), (reference[0], *reference[2])
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            errors[name] = float((a.float() - b.float()).abs().max() / b.float().abs().max())
        del got, want, a, b
    del result
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = fwd_bwd()
    torch.cuda.synchronize()
    peak_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
    del result
    fwd_ms = median_ms(fwd, args.reps, args.warmup, events=True, across_ranks=False)
    fwd_bwd_ms = median_ms(fwd_bwd, args.reps, args.warmup, events=True, across_ranks=False)
    fwd_flops = FWD_FLOPS_PER_PAIR * args.heads * args.head_dim * sum(map(visible_pairs, q_lens, k_lens))
    return {
        "variant": variant,
        "fwd_ms": fwd_ms,
        "fwd_tflops": fwd_flops / (fwd_ms * 1e-3) / 1e12,
        "fwd_bwd_ms": fwd_bwd_ms,
        "fwd_bwd_tflops": FWD_BWD_FACTOR * fwd_flops / (fwd_bwd_ms * 1e-3) / 1e12,
        "peak_gib": peak_gib,
        "rel_err_vs_fa2": errors,
    }


def plan_costs(args) -> list[str]:
    """First cuDNN call in the process (handle, library load, first plans) and a new shape's plan builds."""
    from hf_distca.kernels import attention_backward, attention_forward, cudnn_frontend

    lines = []
    for label, q_lens in (
        ("first call in the process", [3000, 1000]),
        ("a new shape (new plans)", [5000, 11000]),
    ):
        q, k, v, dout, kargs = make_inputs(q_lens, q_lens, args, seed=1)
        before = dict(cudnn_frontend.plan_builds)
        times = []
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out, lse = attention_forward(q, k, v, *kargs, backend="cudnn")
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            attention_backward(dout, q, k, v, out, lse, *kargs, backend="cudnn")
            torch.cuda.synchronize()
            times.append((t1 - t0, time.perf_counter() - t1))
        built = {d: cudnn_frontend.plan_builds[d] - before[d] for d in before}
        lines.append(
            f"| {label} | {times[0][0] * 1e3:.1f} | {times[0][1] * 1e3:.1f} | {times[1][0] * 1e3:.1f} | "
            f"{times[1][1] * 1e3:.1f} | {built['forward']} / {built['backward']} |"
        )
    return lines


def time_any_ms(fn: Callable[[], None], args) -> float:
    """Median ms of ``fn``: CUDA events on the GPU, the host clock on the CPU (--smoke, no warmup)."""
    if not args.smoke:
        return median_ms(fn, args.reps, args.warmup, events=True, across_ranks=False)
    return median_ms(fn, args.reps, 0, device=torch.device("cpu"), across_ranks=False)


def windows_main(args, command: str) -> int:
    """One document of args.tokens tokens: full causal and each window, every variant (see the docstring)."""
    from hf_distca.kernels import attention_backward, attention_forward, available_backends

    if args.smoke:
        variants, header = ["reference"], "CPU smoke run (reference kernel, float32): not a measurement"
    else:
        usable = available_backends(torch.device("cuda"), torch.bfloat16)
        variants = [v for v in args.variants if v.partition(":")[0] in usable]
        header = (
            f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"cuDNN {torch.backends.cudnn.version()}"
        )
    n = args.tokens
    q, k, v, dout, kargs = make_inputs([n], [n], args)
    lines = [
        "# Sliding-window varlen attention: one document, full causal vs windows",
        "",
        f"- command: `{command}`",
        f"- {header}",
        f"- one document of {n} tokens, {args.heads} query / {args.kv_heads} KV heads x {args.head_dim}; "
        f"TFLOP/s count the pairs each window computes (min(i + 1, W) per query), forward = "
        f"{FWD_FLOPS_PER_PAIR} x Hq x D per pair, forward+backward = {FWD_BWD_FACTOR} x that; "
        f"median of {args.reps} after {args.warmup} warm-ups",
        "",
        "| window | pairs / causal | variant | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | time / causal |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    causal_ms: dict[str, float] = {}
    for window in [None, *args.windows]:
        pairs = visible_pairs(n, n, window)
        for variant in variants:
            run = variant_kwargs(variant)

            def fwd(run=run, window=window):
                return attention_forward(q, k, v, *kargs, window=window, **run)

            def fwd_bwd(fwd=fwd, run=run, window=window):
                out, lse = fwd()
                attention_backward(dout, q, k, v, out, lse, *kargs, window=window, **run)

            label = "causal" if window is None else str(window)
            try:
                fwd_bwd()
                fwd_ms, fwd_bwd_ms = time_any_ms(fwd, args), time_any_ms(fwd_bwd, args)
            except Exception as err:  # one failing variant must not hide the others' numbers
                traceback.print_exc()
                lines.append(f"| {label} | | {variant} | error: {type(err).__name__}: {str(err)[:120]} |||||")
                continue
            if window is None:
                causal_ms[variant] = fwd_bwd_ms
            flops = FWD_FLOPS_PER_PAIR * args.heads * args.head_dim * pairs
            ratio = fwd_bwd_ms / causal_ms[variant] if variant in causal_ms else float("nan")
            lines.append(
                f"| {label} | {pairs / visible_pairs(n, n):.3f} | {variant} | {fwd_ms:.2f} | "
                f"{flops / (fwd_ms * 1e-3) / 1e12:.1f} | {fwd_bwd_ms:.2f} | "
                f"{FWD_BWD_FACTOR * flops / (fwd_bwd_ms * 1e-3) / 1e12:.1f} | {ratio:.3f} |"
            )
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    write_report(text, args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    script_args = sys.argv[1:] if argv is None else argv
    command = " ".join(shlex.quote(a) for a in ["python", "-m", "benchmarks.bench_kernels", *script_args])
    if args.windows and args.smoke:
        return windows_main(args, command)
    if not torch.cuda.is_available():
        print("bench_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    from hf_distca.kernels import available_backends, cudnn_frontend

    usable = available_backends(torch.device("cuda"), torch.bfloat16)
    variants = [v for v in args.variants if v.partition(":")[0] in usable]
    skipped = [v for v in args.variants if v not in variants]
    if args.windows:
        return windows_main(args, command)
    lines = [
        "# Varlen attention kernels: throughput and peak memory",
        "",
        f"- command: `{command}`",
        f"- GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"cuDNN {torch.backends.cudnn.version()}",
    ]
    if "cudnn" in usable:
        import cudnn

        lines.append(
            f"- cudnn-frontend {getattr(cudnn, '__version__', '?')} (backend {cudnn.backend_version()})"
        )
    lines += [
        f"- bf16, {args.heads} query heads / {args.kv_heads} KV heads x {args.head_dim}, causal (bottom-right "
        f"for suffix tasks), ~{args.tokens} packed tokens per call; explicit forward then backward",
        f"- time: median of {args.reps} after {args.warmup} warm-ups, CUDA events; TFLOP/s: forward = "
        f"{FWD_FLOPS_PER_PAIR} x Hq x D per visible (query, key) pair, forward+backward = {FWD_BWD_FACTOR} x that",
        "- peak: most memory allocated during one forward+backward beyond the inputs (GiB)",
        "- err: max |x - FA2| / max |FA2| of out, dq, dk, dv against torch_varlen",
    ]
    if skipped:
        lines.append(f"- not available here: {skipped}")
    plan_lines = []
    if "cudnn" in usable:  # first: the first cuDNN call of the process is part of what it measures
        try:
            plan_lines = plan_costs(args)
        except Exception as err:
            traceback.print_exc()
            plan_lines = [f"| error: {type(err).__name__}: {err} ||||||"]
    rows = workloads(args)
    results: dict[tuple[str, str], dict] = {}
    detail = [
        "",
        "| workload | variant | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | peak GiB | err out/dq/dk/dv |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, q_lens, k_lens in rows:
        inputs = make_inputs(q_lens, k_lens, args)
        reference = None
        for variant in variants:
            try:
                r = bench_one(variant, q_lens, k_lens, args, inputs, reference)
            except Exception as err:  # one failing variant must not hide the others' numbers
                traceback.print_exc()
                results[(name, variant)] = {"error": f"{type(err).__name__}: {err}"[:200]}
                detail.append(f"| {name} | {variant} | error: {results[(name, variant)]['error']} |||||||")
                continue
            if variant == "torch_varlen":
                from hf_distca.kernels import attention_backward, attention_forward

                out, lse = attention_forward(*inputs[:3], *inputs[4], backend="torch_varlen")
                reference = (out, lse, attention_backward(inputs[3], *inputs[:3], out, lse, *inputs[4]))
            results[(name, variant)] = r
            err = "/".join(f"{e:.1e}" for e in r["rel_err_vs_fa2"].values()) or "-"
            detail.append(
                f"| {name} | {variant} | {r['fwd_ms']:.2f} | {r['fwd_tflops']:.0f} | {r['fwd_bwd_ms']:.2f} | "
                f"{r['fwd_bwd_tflops']:.0f} | {r['peak_gib']:.2f} | {err} |"
            )
            print(detail[-1], flush=True)
        del inputs, reference
        torch.cuda.empty_cache()

    summary = [
        "",
        "## Forward+backward TFLOP/s (the issue's table)",
        "",
        "| workload | " + " | ".join(variants) + " | best cuDNN / FA2 |",
        "|---|" + "---:|" * len(variants) + "---:|",
    ]
    for name, _, _ in rows:
        cells, fa2, best = [], None, None
        for variant in variants:
            r = results.get((name, variant), {})
            tf = r.get("fwd_bwd_tflops")
            cells.append(f"{tf:.0f}" if tf is not None else "error")
            if tf is not None and variant == "torch_varlen":
                fa2 = tf
            elif tf is not None:
                best = max(best or 0.0, tf)
        ratio = f"{best / fa2:.2f}x" if fa2 and best else "-"
        summary.append(f"| {name} | " + " | ".join(cells) + f" | {ratio} |")

    extra = []
    if "cudnn" in usable:
        extra += [
            "",
            "## cuDNN plan builds",
            "",
            "| call | 1st fwd ms | 1st bwd ms | 2nd fwd ms | 2nd bwd ms | plans built fwd / bwd |",
            "|---|---:|---:|---:|---:|---|",
        ]
        extra += plan_lines
        extra += [
            "",
            f"Plans built in the whole run: {cudnn_frontend.plan_builds}; backward log-sum-exp layout: "
            f"{'packed (ragged)' if cudnn_frontend.ragged_backward_stats else 'padded'}.",
            "",
            "## Cost of rounding plan shapes up (fwd+bwd TFLOP/s, exact shapes / bucketed shapes)",
            "",
            "| workload | " + " | ".join(v for v in variants if v.startswith("cudnn")) + " |",
            "|---|" + "---:|" * sum(v.startswith("cudnn") for v in variants),
        ]
        for name, q_lens, k_lens in rows:
            if not name.startswith(("mixed", "suffix 1K", "2K docs", "server")):
                continue
            inputs = make_inputs(q_lens, k_lens, args)
            cells = []
            for variant in (v for v in variants if v.startswith("cudnn")):
                pair = []
                for bucket_shapes in (False, True):  # exact shapes, then bucketed
                    try:
                        r = bench_one(variant, q_lens, k_lens, args, inputs, bucket_shapes=bucket_shapes)
                        pair.append(f"{r['fwd_bwd_tflops']:.0f}")
                    except Exception as err:
                        traceback.print_exc()
                        pair.append(f"error: {type(err).__name__}")
                cells.append(" / ".join(pair))
            extra.append(f"| {name} | " + " | ".join(cells) + " |")
            del inputs
            torch.cuda.empty_cache()

    text = "\n".join(lines + summary + ["", "## Details"] + detail + extra) + "\n"
    write_report(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
