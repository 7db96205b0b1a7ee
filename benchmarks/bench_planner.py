"""Planner benchmark on realistic document lengths (CPU only, no process group).

Draws packed global batches from a JSON list of document lengths, lays each batch out back to back
over ``--world`` ranks of ``--tokens-per-rank`` tokens (documents cut at rank boundaries, as the
rebatcher's simplest packing does), plans core attention and prints a markdown table: attention
imbalance (max / mean causal FLOPs per server) before and after planning, planning time, and the
bytes each rank sends per layer in the forward (Q and KV out, outputs back).

Example (the DistCA sample files are described in the shared data README):

    python benchmarks/bench_planner.py --doclens PATH/doclens_pretrain.json --world 8 32 64 \
        --tokens-per-rank 65536 --batches 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from hf_distca import DistCAConfig, plan_core_attention


def draw_batch(doclens: np.ndarray, total: int, rng: np.random.Generator) -> list[int]:
    """Random documents until ``total`` tokens; the last one is truncated so the batch is exactly full."""
    out, used = [], 0
    while used < total:
        n = int(min(doclens[rng.integers(len(doclens))], total - used))
        if n > 0:
            out.append(n)
            used += n
    return out


def pack(lens: list[int], world: int, per_rank: int) -> list[list[tuple[int, int, int]]]:
    """Documents back to back, cut into ``world`` runs of ``per_rank`` tokens: per-rank pieces."""
    pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    rank, used = 0, 0
    for doc, length in enumerate(lens):
        start = 0
        while start < length:
            n = min(length - start, per_rank - used)
            pieces[rank].append((doc, start, n))
            start, used = start + n, used + n
            if used == per_rank:
                rank, used = rank + 1, 0
    return pieces


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--doclens", required=True, help="JSON file: a list of document lengths in tokens")
    p.add_argument(
        "--world", type=int, nargs="+", default=[8, 64], help="numbers of servers (one table row each)"
    )
    p.add_argument("--tokens-per-rank", type=int, default=65536)
    p.add_argument("--batches", type=int, default=5, help="global batches drawn per world size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=0.1)
    p.add_argument("--shard-tokens", type=int, default=128)
    p.add_argument("--max-recv-mib", type=float, default=None, help="receive bound per server (MiB)")
    p.add_argument("--heads", type=int, default=32, help="query heads (bytes per row only)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--elem-bytes", type=int, default=2, help="2 for bf16")
    args = p.parse_args(argv)

    with open(args.doclens) as f:
        doclens = np.asarray(json.load(f), dtype=np.int64)
    if doclens.ndim != 1 or len(doclens) == 0 or (doclens <= 0).any():
        raise SystemExit(f"{args.doclens}: expected a non-empty JSON list of positive integers")
    q_row = args.heads * args.head_dim * args.elem_bytes
    kv_row = 2 * args.kv_heads * args.head_dim * args.elem_bytes
    bound = None if args.max_recv_mib is None else int(args.max_recv_mib * 2**20)
    config = DistCAConfig(
        tolerance=args.tolerance, shard_tokens=args.shard_tokens, max_recv_bytes_per_server=bound
    )
    rng = np.random.default_rng(args.seed)
    plan_core_attention([[(0, 0, 1)]], q_row_bytes=q_row, kv_row_bytes=kv_row, config=config)  # warm-up

    print(
        f"doclens: {len(doclens)} documents (median {int(np.median(doclens))}, max {int(doclens.max())}); "
        f"{args.tokens_per_rank} tokens per rank; tolerance {args.tolerance}, shard_tokens {args.shard_tokens}; "
        f"bytes per row: Q {q_row}, KV {kv_row}; medians over {args.batches} batches\n"
    )
    print(
        "| servers | docs / batch | imbalance before | imbalance after | moves | plan ms (median) | plan ms (max) "
        "| MiB sent / rank / layer (mean) | (max) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for world in args.world:
        rows = []
        for _ in range(args.batches):
            lens = draw_batch(doclens, world * args.tokens_per_rank, rng)
            pieces = pack(lens, world, args.tokens_per_rank)
            t0 = time.perf_counter()
            plan = plan_core_attention(pieces, q_row_bytes=q_row, kv_row_bytes=kv_row, config=config)
            seconds = time.perf_counter() - t0
            rows.append(
                (len(lens), plan.imbalance_before, plan.imbalance_after, plan.moves, seconds,
                 statistics.fmean(plan.bytes_sent) / 2**20, max(plan.bytes_sent) / 2**20)
            )  # fmt: skip
        med = [statistics.median(c) for c in zip(*rows)]
        print(
            f"| {world} | {med[0]:.0f} | {med[1]:.2f} | {med[2]:.3f} | {med[3]:.0f} | {med[4] * 1e3:.1f} "
            f"| {max(r[4] for r in rows) * 1e3:.1f} | {med[5]:.1f} | {med[6]:.1f} |"
        )


if __name__ == "__main__":
    main()
