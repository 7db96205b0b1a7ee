"""Throughput of the varlen kernel backends on packed causal documents (CUDA only).

For each document length L, packs ``tokens // L`` documents of L tokens (the total stays fixed), and
times forward and forward+backward of every available CUDA backend with CUDA events (warm-ups, then
the median of several repetitions). Reports TFLOP/s with the causal convention: forward FLOPs =
4 * Hq * D per causal (query, key) pair, L * (L + 1) / 2 pairs per document; forward+backward =
3.5 x forward (backward ~2.5 x forward). Writes a markdown table with the command line, torch
version and GPU name.

    python benchmarks/bench_kernels.py --out benchmarks/results/kernels.md
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
from collections.abc import Callable

import torch

try:
    import hf_distca  # noqa: F401
except ImportError:  # run from a checkout without installing: the package sits next to benchmarks/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FWD_FLOPS_PER_PAIR = 4  # x Hq x D: QK^T and PV, 2 FLOPs per multiply-add each
FWD_BWD_FACTOR = 3.5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="markdown file to write the table to (default: print only)")
    p.add_argument("--lengths", default="512,2048,8192,32768", help="comma-separated document lengths")
    p.add_argument("--tokens", type=int, default=65536, help="packed tokens per call (fixed across lengths)")
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads (GQA)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument(
        "--backends",
        default="auto",
        help="comma-separated subset of torch_varlen,flash_attn (auto: all available)",
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before timing")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions; the median is reported")
    args = p.parse_args(argv)
    try:
        args.lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        p.error(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    if not args.lengths or min(args.lengths) < 1:
        p.error("--lengths needs at least one positive length")
    if args.tokens < 1 or args.reps < 1 or args.warmup < 0:
        p.error("--tokens and --reps must be positive, --warmup non-negative")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    return args


def causal_pairs(length: int) -> int:
    return length * (length + 1) // 2


def time_ms(fn: Callable[[], None], warmup: int, reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs, each timed with its own pair of CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_one(backend: str, length: int, args: argparse.Namespace) -> dict:
    from hf_distca.kernels import varlen_attention

    n_docs = max(1, args.tokens // length)
    total = n_docs * length
    dtype = getattr(torch, args.dtype)
    dev = torch.device("cuda")
    q = torch.randn(
        total, args.heads, args.head_dim, device=dev, dtype=dtype, requires_grad=True
    )  # (T, Hq, D)
    k = torch.randn(
        total, args.kv_heads, args.head_dim, device=dev, dtype=dtype, requires_grad=True
    )  # (T, Hkv, D)
    v = torch.randn(
        total, args.kv_heads, args.head_dim, device=dev, dtype=dtype, requires_grad=True
    )  # (T, Hkv, D)
    dout = torch.randn(total, args.heads, args.head_dim, device=dev, dtype=dtype)  # (T, Hq, D)
    cu = torch.arange(0, total + 1, length, device=dev, dtype=torch.int32)  # (n_docs + 1,)
    scale = args.head_dim**-0.5

    def forward() -> torch.Tensor:
        return varlen_attention(q, k, v, cu, cu, length, length, scale=scale, backend=backend)

    def fwd_only() -> None:
        with torch.no_grad():
            forward()

    def fwd_bwd() -> None:
        q.grad = k.grad = v.grad = None
        forward().backward(dout)

    fwd_ms = time_ms(fwd_only, args.warmup, args.reps)
    fwd_bwd_ms = time_ms(fwd_bwd, args.warmup, args.reps)
    fwd_flops = FWD_FLOPS_PER_PAIR * args.heads * args.head_dim * n_docs * causal_pairs(length)
    return {
        "backend": backend,
        "length": length,
        "docs": n_docs,
        "tokens": total,
        "fwd_ms": fwd_ms,
        "fwd_tflops": fwd_flops / (fwd_ms * 1e-3) / 1e12,
        "fwd_bwd_ms": fwd_bwd_ms,
        "fwd_bwd_tflops": FWD_BWD_FACTOR * fwd_flops / (fwd_bwd_ms * 1e-3) / 1e12,
    }


def to_markdown(rows: list[dict], args: argparse.Namespace, command: str) -> str:
    props = torch.cuda.get_device_properties(0)
    lines = [
        "# Varlen attention kernel throughput",
        "",
        f"- command: `{command}`",
        f"- GPU: {torch.cuda.get_device_name(0)} ({props.total_memory / 2**30:.0f} GiB)",
        f"- torch {torch.__version__}, CUDA {torch.version.cuda}",
        f"- {args.dtype}, {args.heads} query heads / {args.kv_heads} KV heads x {args.head_dim}, causal, "
        f"packed documents of equal length, ~{args.tokens} tokens per call",
        f"- time: median of {args.reps} repetitions after {args.warmup} warm-ups, CUDA events",
        f"- FLOPs (causal convention): forward = {FWD_FLOPS_PER_PAIR} x Hq x D per causal (query, key) pair "
        f"(L(L+1)/2 pairs per document); forward+backward = {FWD_BWD_FACTOR} x forward",
        "",
        "| backend | doc length | docs | tokens | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['backend']} | {r['length']} | {r['docs']} | {r['tokens']} | {r['fwd_ms']:.3f} | "
            f"{r['fwd_tflops']:.1f} | {r['fwd_bwd_ms']:.3f} | {r['fwd_bwd_tflops']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False); the varlen kernel "
            "backends it measures run on CUDA only. Run it on a GPU machine.",
            file=sys.stderr,
        )
        return 2
    from hf_distca.kernels import available_backends

    dtype = getattr(torch, args.dtype)
    usable = [b for b in available_backends(torch.device("cuda"), dtype) if b != "reference"]
    wanted = usable if args.backends == "auto" else [b.strip() for b in args.backends.split(",") if b.strip()]
    missing = [b for b in wanted if b not in usable]
    if missing:
        print(f"backend(s) {missing} not available here (available: {usable})", file=sys.stderr)
        return 2
    if not wanted:
        print(
            "no CUDA kernel backend is available (torch.nn.attention.varlen or flash-attn)", file=sys.stderr
        )
        return 2
    script_args = sys.argv[1:] if argv is None else argv
    command = " ".join(shlex.quote(a) for a in ["python", "benchmarks/bench_kernels.py", *script_args])
    rows = []
    for backend in wanted:
        for length in args.lengths:
            rows.append(bench_one(backend, length, args))
            r = rows[-1]
            print(
                f"{backend:13s} L={length:6d} x{r['docs']:4d}: fwd {r['fwd_ms']:8.3f} ms {r['fwd_tflops']:6.1f} TFLOP/s"
                f" | fwd+bwd {r['fwd_bwd_ms']:8.3f} ms {r['fwd_bwd_tflops']:6.1f} TFLOP/s",
                flush=True,
            )
            torch.cuda.empty_cache()
    text = to_markdown(rows, args, command)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
