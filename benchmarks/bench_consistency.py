"""Cost of the engine's cross-rank consistency check per micro-batch (run with torchrun on N GPUs, NCCL).

The check runs once per new micro-batch layout (``all_pieces`` object): every rank validates and
digests its inputs and all ranks all-gather one small int64 vector (hf_distca.engine.consistency).
This times ``hf_distca.engine.prepare`` (plan cached, so planning is not in the figure) for
- a new layout object with the check on (what the first layer of every micro-batch pays),
- the same with ``DistCAConfig(check_consistency=False)`` (the difference is the check itself),
- a layout object already seen (what every further layer pays),
- no ``all_pieces`` (the engine all-gathers the pieces on every call; the check rides along),
on realistic layouts: the rebatcher's pieces of micro-batches drawn from a length sample, and a
synthetic layout with many short pieces. Llama-3-8B attention shapes (32/8 heads x 128), bf16.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 -m benchmarks.bench_consistency --out results.md
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch
import torch.distributed as dist

from hf_distca import DistCAConfig
from hf_distca.data.rebatch import layout_pieces
from hf_distca.engine import prepare, probe

from .common import init_nccl, median_ms

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def layouts(world: int, tokens: int, sample: list[int] | None, seed: int) -> dict[str, list]:
    out = {}
    if sample is not None:
        rng = np.random.default_rng(seed)
        lengths, total = [], 0
        while total < world * tokens:
            n = int(min(rng.choice(sample), world * tokens - total))
            lengths.append(n)
            total += n
        out[f"sample ({len(lengths)} documents)"] = layout_pieces(
            lengths, world_size=world, tokens_per_rank=tokens
        )
    short = [128] * (world * tokens // 128)
    out[f"{len(short)} documents of 128"] = layout_pieces(short, world_size=world, tokens_per_rank=tokens)
    return {
        name: [tuple(tuple(int(x) for x in p) for p in r) for r in pieces] for name, pieces in out.items()
    }


def measure(name: str, all_pieces: list, rank: int, iters: int) -> str:
    """One table row: prepare's cost in each situation (see the module docstring)."""
    group = dist.group.WORLD
    pieces = all_pieces[rank]
    tokens = sum(n for _, _, n in pieces)
    q = torch.randn(tokens, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(tokens, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    on, off = DistCAConfig(), DistCAConfig(check_consistency=False)
    probe(
        on, device=q.device, dtypes=[q.dtype], q_heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM
    )  # start-up

    def fresh(config: DistCAConfig) -> None:
        copy = tuple(tuple(r) for r in all_pieces)  # a new object with the same content: plan cached
        prepare(q, kv, kv, pieces, group=group, config=config, all_pieces=copy)

    def seen() -> None:
        prepare(q, kv, kv, pieces, group=group, config=on, all_pieces=all_pieces)

    def gathered() -> None:
        prepare(q, kv, kv, pieces, group=group, config=on)

    new_on, new_off = median_ms(lambda: fresh(on), iters, 3), median_ms(lambda: fresh(off), iters, 3)
    return (
        f"| {name} | {max(len(r) for r in all_pieces)} | {new_on:.3f} | {new_off:.3f} | {new_on - new_off:.3f} | "
        f"{median_ms(seen, iters, 3):.3f} | {median_ms(gathered, iters, 3):.3f} |"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens-per-rank", type=int, default=65536)
    p.add_argument("--doc-lengths", default=None, help="JSON list of document lengths to draw layouts from")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    started = init_nccl("bench_consistency.py")
    if started is None:
        return 2
    rank, world = started
    sample = None
    if args.doc_lengths:
        with open(args.doc_lengths) as f:
            sample = [int(x) for x in json.load(f)]
    rows = []
    for name, all_pieces in layouts(world, args.tokens_per_rank, sample, seed=0).items():
        rows.append(measure(name, all_pieces, rank, args.iters))
    if rank == 0:
        text = "\n".join(
            [
                f"## Consistency check cost, {world} x {torch.cuda.get_device_name()}, NCCL",
                "",
                f"Command: `NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node {world} -m benchmarks.bench_consistency {' '.join(sys.argv[1:])}`",
                "",
                f"torch {torch.__version__}; {args.tokens_per_rank} tokens per rank, q (T, {HEADS}, {HEAD_DIM}) and "
                f"k/v (T, {KV_HEADS}, {HEAD_DIM}) bf16; plan cached; milliseconds, median of {args.iters} "
                "(slowest rank). The check runs once per micro-batch (first layer); further layers pay the "
                "'layout already seen' column.",
                "",
                "| layout | pieces per rank (max) | new layout, check on | new layout, check off | "
                "the check | layout already seen | no all_pieces (gathered every call) |",
                "|---|---|---|---|---|---|---|",
                *rows,
                "",
            ]
        )
        print(text, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(text + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
