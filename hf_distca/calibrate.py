"""Measure the CA-task cost table for ``DistCAConfig(cost_table=...)``: the command line.

    python -m hf_distca.calibrate --out cost_table.json --heads 32 --kv-heads 8 --head-dim 128

Times the varlen kernel on every (q_len, kv_len) of the grid with q_len <= kv_len, forward plus backward
by default, and writes seconds per task (how: :mod:`hf_distca.cost_tables.timing`). Run it on the
training GPUs with the model's head shape, dtype and kernel backend. The table records its provenance
(GPU, dtype, heads, kernel, torch/CUDA/cuDNN versions).

``--startup`` measures the reduced grid that ``DistCAConfig(cost_table="auto")`` measures at the first
engine call when no shipped table (:mod:`hf_distca.cost_tables`) fits; the command prints how long the
measurement took.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch

from hf_distca.cost_tables.timing import STARTUP_LENS, STARTUP_REPEATS, STARTUP_WARMUP, provenance, time_table
from hf_distca.kernels import KERNEL_BACKENDS
from hf_distca.planning.cost import MeasuredCost, write_cost_table

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULT_LENS = [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]


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
    p.add_argument(
        "--startup",
        action="store_true",
        help=f"the grid and repeats of the start-up measurement of cost_table='auto' (lengths {STARTUP_LENS}, "
        f"{STARTUP_WARMUP} warm-up and {STARTUP_REPEATS} timed calls per cell); overrides those options",
    )
    args = p.parse_args(argv)
    if args.startup:
        args.q_lens, args.kv_lens = list(STARTUP_LENS), list(STARTUP_LENS)
        args.warmup, args.repeats = STARTUP_WARMUP, STARTUP_REPEATS
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
    start = time.perf_counter()
    seconds, backend = time_table(
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
    elapsed = time.perf_counter() - start
    measured = provenance(
        device,
        args.dtype,
        backend,
        args.heads,
        args.kv_heads,
        args.head_dim,
        timed="forward" if args.forward_only else "forward+backward",
        fuse_tokens=args.fuse_tokens,
        repeats=args.repeats,
    )
    measured["command"] = " ".join(
        ["python -m hf_distca.calibrate", *(sys.argv[1:] if argv is None else argv)]
    )
    write_cost_table(args.out, q_lens, kv_lens, seconds, measured)
    print(
        f"wrote {args.out}: {len(q_lens)} x {len(kv_lens)} grid measured in {elapsed:.2f} s; "
        f"use DistCAConfig(cost_table={args.out!r})"
    )
    return MeasuredCost.from_json(args.out)


if __name__ == "__main__":
    main()
