"""Measure the CA-task cost table for ``DistCAConfig(cost_table=...)``.

    python -m hf_distca.calibrate --out cost_table.json --heads 32 --kv-heads 8 --head-dim 128

For every (q_len, kv_len) of the grid with q_len <= kv_len, times the varlen kernel on tasks of q_len
queries at the end of a kv_len-token KV prefix (bottom-right causal, the shape of a CA-task), forward
plus backward by default, and writes seconds per task. Several copies of a short task run fused in one
kernel call (as a server runs all its tasks in one call), so a cell is the marginal time of one task
in a fused call, not the launch latency. On CUDA the time comes from CUDA events; elsewhere from the
wall clock (the ``reference`` kernel on the CPU: only useful to test the command end to end).
Run it on the training GPUs with the model's head shape, dtype and kernel backend.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Sequence

import torch

from hf_distca.config import KERNEL_BACKENDS
from hf_distca.engine import local_attention
from hf_distca.kernels import resolve_backend
from hf_distca.planning.cost import MeasuredCost, write_cost_table

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULT_LENS = [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]


def time_task(
    q_len: int,
    kv_len: int,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    backend: str,
    backward: bool,
    fuse_tokens: int,
    warmup: int,
    repeats: int,
) -> float:
    """Median seconds of one (q_len, kv_len) task, measured as ``copies`` tasks fused in one kernel call."""
    copies = max(1, fuse_tokens // kv_len)
    gen = torch.Generator(device=device).manual_seed(q_len * 1_000_003 + kv_len)
    q = torch.randn(copies * q_len, heads, head_dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(copies * kv_len, kv_heads, head_dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn_like(k)
    q.requires_grad_(backward)
    k.requires_grad_(backward)
    v.requires_grad_(backward)
    cu_q = torch.arange(copies + 1, device=device, dtype=torch.int32) * q_len  # (copies + 1,)
    cu_k = torch.arange(copies + 1, device=device, dtype=torch.int32) * kv_len  # (copies + 1,)
    dout = torch.randn_like(q) if backward else None

    def run() -> None:
        out = local_attention(q, k, v, cu_q, cu_k, q_len, kv_len, backend=backend)
        if backward:
            torch.autograd.grad(out, (q, k, v), dout)

    for _ in range(warmup):
        run()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            run()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples) / copies


def calibrate(
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    backend: str = "auto",
    backward: bool = True,
    fuse_tokens: int = 65536,
    warmup: int = 3,
    repeats: int = 10,
    log=print,
) -> tuple[list[list[float | None]], str]:
    """The seconds table (None where q_len > kv_len) and the concrete backend that ran it."""
    name = resolve_backend(backend, device, dtype)
    seconds: list[list[float | None]] = []
    for q_len in q_lens:
        row: list[float | None] = []
        for kv_len in kv_lens:
            if q_len > kv_len:
                row.append(None)
                continue
            t = time_task(
                q_len,
                kv_len,
                heads=heads,
                kv_heads=kv_heads,
                head_dim=head_dim,
                dtype=dtype,
                device=device,
                backend=name,
                backward=backward,
                fuse_tokens=fuse_tokens,
                warmup=warmup,
                repeats=repeats,
            )
            pairs = (kv_len * (kv_len + 1) - (kv_len - q_len) * (kv_len - q_len + 1)) // 2
            flops = (4 if not backward else 14) * heads * head_dim * pairs  # fwd 4, bwd ~10 per pair
            log(f"q_len {q_len:>6} kv_len {kv_len:>6}: {t * 1e3:10.4f} ms  ~{flops / t / 1e12:7.1f} TFLOP/s")
            row.append(t)
        seconds.append(row)
    return seconds, name


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="where to write the JSON table (DistCAConfig.cost_table)")
    p.add_argument("--q-lens", type=int, nargs="+", default=DEFAULT_LENS, help="query lengths of the grid")
    p.add_argument(
        "--kv-lens", type=int, nargs="+", default=DEFAULT_LENS, help="KV prefix lengths of the grid"
    )
    p.add_argument("--heads", type=int, default=32, help="query heads (the model's num_attention_heads)")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads (num_key_value_heads)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--backend", choices=KERNEL_BACKENDS, default="auto", help="kernel backend (as in DistCAConfig)"
    )
    p.add_argument(
        "--forward-only", action="store_true", help="time the forward only (default: forward+backward)"
    )
    p.add_argument(
        "--fuse-tokens", type=int, default=65536, help="KV tokens per timed kernel call (short tasks fused)"
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10, help="timed calls per cell (the median is kept)")
    args = p.parse_args(argv)
    for name in ("heads", "kv_heads", "head_dim", "fuse_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if min(args.q_lens + args.kv_lens) < 1:
        p.error("--q-lens and --kv-lens must be positive")
    if min(args.q_lens) > max(args.kv_lens):
        p.error("no cell has q_len <= kv_len: give some --q-lens no larger than the largest --kv-lens")
    return args


def main(argv: Sequence[str] | None = None) -> MeasuredCost:
    """Measure, write ``--out`` and return the table as the planner will load it."""
    args = parse_args(argv)
    q_lens, kv_lens = sorted(set(args.q_lens)), sorted(set(args.kv_lens))
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    seconds, backend = calibrate(
        q_lens,
        kv_lens,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=dtype,
        device=device,
        backend=args.backend,
        backward=not args.forward_only,
        fuse_tokens=args.fuse_tokens,
        warmup=args.warmup,
        repeats=args.repeats,
    )
    measured = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "dtype": args.dtype,
        "backend": backend,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "timed": "forward" if args.forward_only else "forward+backward",
        "fuse_tokens": args.fuse_tokens,
        "repeats": args.repeats,
        "torch": torch.__version__,
    }
    write_cost_table(args.out, q_lens, kv_lens, seconds, measured)
    print(f"wrote {args.out}: {len(q_lens)} x {len(kv_lens)} grid; use DistCAConfig(cost_table={args.out!r})")
    return MeasuredCost.from_json(args.out)


if __name__ == "__main__":
    main()
