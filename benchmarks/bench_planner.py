"""Planner benchmark on realistic document lengths (CPU only, no process group).

Treats a JSON list of document lengths as the dataset and builds global batches exactly as training
does: ``plan_global_batches`` (shuffled, token-budget packing, one micro-batch of ``world x
tokens-per-rank`` tokens per step) and the rebatcher's ``layout_pieces`` (documents placed whole
where they fit, longer ones cut over ranks head/tail; padding to the budget). Then it plans core
attention for the first ``--batches`` steps and prints a markdown table: attention imbalance (max /
mean causal attention cost per server) with every rank computing its own pieces with their full
context ("before", the metrics records' ``imbalance_before``) and after planning, planning time, and
the bytes each rank sends per layer in the forward (Q and KV out, outputs back).

Example (the DistCA sample files are described in the shared data README):

    python benchmarks/bench_planner.py --doclens PATH/doclens_pretrain.json --world 8 32 64 \
        --tokens-per-rank 65536 --batches 5
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np

from hf_distca import plan_core_attention
from hf_distca.cli import add_config_arguments, config_from_args
from hf_distca.data import layout_pieces, plan_global_batches


def global_batches(doclens: list[int], world: int, per_rank: int, batches: int, seed: int):
    """(documents, filled fraction, per-rank pieces) of the first ``batches`` global micro-batches, laid
    out as the training loader lays them out."""
    budget = world * per_rank
    plan = plan_global_batches(doclens, tokens_per_step=budget, micro_batches=1, seed=seed)
    if len(plan) < batches:
        raise SystemExit(f"the sample fills only {len(plan)} batches of {budget} tokens; lower --batches")
    for (docs,) in plan[:batches]:
        lengths = [min(doclens[i], budget) for i in docs]
        yield (
            len(docs),
            sum(lengths) / budget,
            layout_pieces(lengths, world_size=world, tokens_per_rank=per_rank),
        )


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return f"{names[0]} ({len(names)} logical cores)" if names else platform.processor()
    except OSError:
        return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--doclens", required=True, help="JSON file: a list of document lengths in tokens")
    p.add_argument(
        "--world", type=int, nargs="+", default=[8, 64], help="numbers of servers (one table row each)"
    )
    p.add_argument("--tokens-per-rank", type=int, default=65536)
    p.add_argument("--batches", type=int, default=5, help="global batches planned per world size")
    p.add_argument("--seed", type=int, default=0, help="seed of the document shuffle")
    p.add_argument("--heads", type=int, default=32, help="query heads (bytes per row only)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--elem-bytes", type=int, default=2, help="2 for bf16")
    add_config_arguments(p)
    args = p.parse_args(argv)

    with open(args.doclens) as f:
        doclens = np.asarray(json.load(f), dtype=np.int64)
    if doclens.ndim != 1 or len(doclens) == 0 or (doclens <= 0).any():
        raise SystemExit(f"{args.doclens}: expected a non-empty JSON list of positive integers")
    doclens = doclens.tolist()
    q_row = args.heads * args.head_dim * args.elem_bytes
    kv_row = 2 * args.kv_heads * args.head_dim * args.elem_bytes
    config = config_from_args(args)
    plan_core_attention([[(0, 0, 1)]], q_row_bytes=q_row, kv_row_bytes=kv_row, config=config)  # warm-up

    print(
        f"CPU: {cpu_name()}, Python {platform.python_version()}, numpy {np.__version__}\n\n"
        f"doclens: {len(doclens)} documents (median {int(np.median(doclens))}, max {max(doclens)}); "
        f"{args.tokens_per_rank} tokens per rank; tolerance {config.tolerance}, shard_tokens {config.shard_tokens}; "
        f"bytes per row: Q {q_row}, KV {kv_row}; medians over {args.batches} batches (seed {args.seed})\n"
    )
    print(
        "| servers | docs / batch | fill | cut docs / batch | imbalance before | imbalance after | moves "
        "| plan ms (median) | plan ms (max) | MiB sent / rank / layer (mean) | (max) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for world in args.world:
        rows = []
        for num_docs, fill, pieces in global_batches(
            doclens, world, args.tokens_per_rank, args.batches, args.seed
        ):
            t0 = time.perf_counter()
            plan = plan_core_attention(pieces, q_row_bytes=q_row, kv_row_bytes=kv_row, config=config)
            seconds = time.perf_counter() - t0
            cut = len({p.doc_id for rank in pieces for p in rank if p.doc_start > 0})
            rows.append(
                (num_docs, fill, cut, plan.imbalance_before, plan.imbalance_after, plan.moves, seconds,
                 statistics.fmean(plan.bytes_sent) / 2**20, max(plan.bytes_sent) / 2**20)
            )  # fmt: skip
        med = [statistics.median(c) for c in zip(*rows)]
        print(
            f"| {world} | {med[0]:.0f} | {med[1]:.1%} | {med[2]:.0f} | {med[3]:.2f} | {med[4]:.3f} | {med[5]:.0f} "
            f"| {med[6] * 1e3:.1f} | {max(r[6] for r in rows) * 1e3:.1f} | {med[7]:.1f} | {med[8]:.1f} |"
        )


if __name__ == "__main__":
    main()
