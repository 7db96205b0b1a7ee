"""Planner benchmark on realistic document lengths (CPU only, no process group).

Treats a JSON list of document lengths as the dataset and builds global batches exactly as training
does: ``plan_global_batches`` (shuffled, token-budget packing, one micro-batch of ``world x
tokens-per-rank`` tokens per step) and DistCA's default layout, ``layout_balanced`` (cost-balanced
packing; its documents are cut inside one node when ``--ranks-per-node`` is given, as
``DistCACallback`` does). Then it plans core attention for the first ``--batches`` steps and prints a
markdown table: attention imbalance (max / mean causal attention cost per server) with every rank
computing its own pieces with their full context ("before", the metrics records' ``imbalance_before``)
and after planning, planning time (median and slowest batch), and the bytes each rank sends per layer
in the forward (Q and KV out, outputs back).

Planning time against the step: every batch's plan is also priced by the simulator
(benchmarks/simulate.py, ``price_plan``: Llama-3-8B-shaped, 32 layers, measured H200 kernel and link
tables, non-attention work fitted to this project's H200 measurements, no overlap of communication),
and the table gives the planning time as a percentage of that simulated step (median over batches and
the largest). Each rank plans each micro-batch once, on the CPU, for all layers, so this percentage is
the planner's share of a step when planning is not overlapped with the previous step's GPU work.

The planner balances the cost model of ``--cost-table`` (the DistCAConfig flag): a path plans with that
measured kernel table (e.g. the shipped hf_distca/cost_tables/h200_bf16_32x8x128_torch_varlen.json, what
the default ``"auto"`` resolves to on an H200); ``"auto"`` itself is causal pairs here (no engine, no GPU).
``--cpu-time`` times planning in this process's CPU seconds instead of wall-clock seconds (a shared
machine).

Rows: per server count, one per ``--tokens-per-rank`` budget, then one per ``--docs-per-batch N``: a
budget per rank whose batches hold about N documents (N x mean document length / servers, rounded up to
a multiple of ``shard_tokens``).

With ``--link-gib-per-s`` (and ``--ranks-per-node``, ``--intra-node-gib-per-s``: the DistCAConfig flags)
the planner prices communication, and the table adds the critical path of one layer (forward+backward
core attention plus exposed all-to-all, hf_distca.planning.links) with no balancing, with the
balance-only plan and with the plan, and the KV fan-out (most servers reading one document's KV prefix
from one holder) of the balance-only plan and the plan. The simulated step then uses that bandwidth
between nodes (else ``--sim-inter-node-gibps``) and ``--ranks-per-node`` GPUs per node (else 8).

Example (the DistCA sample files are described in the shared data README):

    python -m benchmarks.bench_planner --doclens PATH/doclens_pretrain.json --world 2 8 64 128 512 \
        --tokens-per-rank 65536 --docs-per-batch 1000 3000 10000 --batches 5 \
        [--link-gib-per-s 23.3 --ranks-per-node 8 --intra-node-gib-per-s 260] [--cost-table TABLE.json]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time

import numpy as np

from hf_distca import plan_core_attention
from hf_distca.cli import add_config_arguments, config_from_args
from hf_distca.config import DistCAConfig, cost_model_from_config
from hf_distca.data import layout_balanced, plan_global_batches
from hf_distca.planning import (
    attention_flops_per_pair,
    link_model_from_options,
    plan_critical_path,
)

from . import sim


def global_batches(
    doclens: list[int], world: int, per_rank: int, batches: int, seed: int, ranks_per_node: int | None
):
    """(documents, filled fraction, per-rank pieces) of the first ``batches`` global micro-batches, laid
    out as the training loader lays them out (DistCACallback's default layout)."""
    budget = world * per_rank
    plan = plan_global_batches(doclens, tokens_per_step=budget, micro_batches=1, seed=seed)
    if len(plan) < batches:
        raise SystemExit(f"the sample fills only {len(plan)} batches of {budget} tokens; lower --batches")
    for (docs,) in plan[:batches]:
        lengths = [min(doclens[i], budget) for i in docs]
        yield (
            len(docs),
            sum(lengths) / budget,
            layout_balanced(
                lengths, world_size=world, tokens_per_rank=per_rank, ranks_per_node=ranks_per_node
            ),
        )


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return f"{names[0]} ({len(names)} logical cores)" if names else platform.processor()
    except OSError:
        return platform.processor() or platform.machine()


def tokens_per_rank_for(docs: int, mean_length: float, world: int, shard_tokens: int) -> int:
    """A per-rank token budget whose batches hold about ``docs`` documents of the sample's mean length."""
    return max(shard_tokens, math.ceil(docs * mean_length / world / shard_tokens) * shard_tokens)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--doclens", required=True, help="JSON file: a list of document lengths in tokens")
    p.add_argument(
        "--world", type=int, nargs="+", default=[8, 64], help="numbers of servers (one table row each)"
    )
    p.add_argument(
        "--tokens-per-rank",
        type=int,
        nargs="*",
        default=[65536],
        help="token budgets per rank, one row each per server count (none: only --docs-per-batch rows)",
    )
    p.add_argument(
        "--docs-per-batch",
        type=int,
        nargs="+",
        default=None,
        help="instead of --tokens-per-rank: per server count, budgets whose batches hold about these many documents",
    )
    p.add_argument("--batches", type=int, default=5, help="global batches planned per row")
    p.add_argument("--seed", type=int, default=0, help="seed of the document shuffle")
    p.add_argument("--heads", type=int, default=32, help="query heads (bytes per row only)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--elem-bytes", type=int, default=2, help="2 for bf16")
    p.add_argument(
        "--sim-inter-node-gibps",
        type=float,
        default=23.3,
        help="GiB/s per GPU between nodes in the simulated step when --link-gib-per-s is not given",
    )
    p.add_argument(
        "--cpu-time",
        action="store_true",
        help="time planning in CPU seconds of this process instead of wall-clock seconds (a shared machine)",
    )
    add_config_arguments(p)
    args = p.parse_args(argv)

    with open(args.doclens) as f:
        doclens = np.asarray(json.load(f), dtype=np.int64)
    if doclens.ndim != 1 or len(doclens) == 0 or (doclens <= 0).any():
        raise SystemExit(f"{args.doclens}: expected a non-empty JSON list of positive integers")
    mean_length = float(doclens.mean())
    doclens = doclens.tolist()
    q_row = args.heads * args.head_dim * args.elem_bytes
    kv_row = 2 * args.kv_heads * args.head_dim * args.elem_bytes
    config = config_from_args(args)
    flops = attention_flops_per_pair(args.heads, args.head_dim)
    cost = cost_model_from_config(config)  # "auto" (the default) is causal pairs here: no engine, no GPU
    link = link_model_from_options(config.planner_options(), cost, flops)
    balance_only = DistCAConfig(**{**config.__dict__, "link_gib_per_s": None})
    model = sim.ModelShape(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                                bytes_per_element=args.elem_bytes)  # fmt: skip
    kernels, linear = sim.KernelTable.from_kernel_rows(), sim.LinearCost.from_measurements()
    links = sim.Links(config.ranks_per_node or 8, sim.NVLINK_ALL_TO_ALL,
                           config.link_gib_per_s or args.sim_inter_node_gibps)  # fmt: skip

    def plan(pieces, cfg=config):
        return plan_core_attention(
            pieces,
            q_row_bytes=q_row,
            kv_row_bytes=kv_row,
            options=cfg.planner_options(),
            cost_model=cost,
            flops_per_pair=flops,
        )

    plan([[(0, 0, 1)]])  # warm-up
    clock = time.process_time if args.cpu_time else time.perf_counter

    print(
        f"CPU: {cpu_name()}, Python {platform.python_version()}, numpy {np.__version__}\n\n"
        f"doclens: {len(doclens)} documents (mean {mean_length:.0f}, median {int(np.median(doclens))}, "
        f"max {max(doclens)}); tolerance {config.balance_tolerance} (balance-only comparator "
        f"{balance_only.balance_tolerance}), shard_tokens {config.shard_tokens}; "
        f"bytes per row: Q {q_row}, KV {kv_row}; medians over {args.batches} batches (seed {args.seed}); "
        f"simulated step: {model.layers} layers, {links.gpus_per_node} GPUs per node, "
        f"{links.inter_gibps:g} GiB/s between nodes; planner cost model: {cost!r}"
        + ("; plan ms: CPU time of this process" if args.cpu_time else "")
        + (
            f"; links: {config.link_gib_per_s} GiB/s, {config.intra_node_gib_per_s} GiB/s inside nodes of "
            f"{config.ranks_per_node} ranks, compute at {config.attention_tflops} TFLOP/s forward+backward"
            if link is not None
            else ""
        )
        + "\n"
    )
    head = (
        "| servers | tokens / rank | docs / batch | fill | cut docs / batch | imbalance before | imbalance after "
        "| moves | plan ms (median) | plan ms (max) | simulated step s (median) | plan % of step (median) "
        "| (max) | MiB sent / rank / layer (mean) | (max) |"
    )
    rule = "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    if link is not None:
        head += " critical path ms: unbalanced | balance-only | plan | KV fan-out: balance-only | plan |"
        rule += "---:|---:|---:|---:|---:|"
    print(head)
    print(rule)
    for world in args.world:
        budgets = list(args.tokens_per_rank) + [
            tokens_per_rank_for(n, mean_length, world, config.shard_tokens) for n in args.docs_per_batch or []
        ]
        for per_rank in budgets:
            setting = sim.Setting(world, per_rank, model, kernels, links, linear)
            rows = []
            for num_docs, fill, pieces in global_batches(
                doclens, world, per_rank, args.batches, args.seed, config.ranks_per_node
            ):
                t0 = clock()
                planned = plan(pieces)
                seconds = clock() - t0
                priced = sim.price_plan(planned, setting)
                step = priced.step_s  # the serial schedule, nothing overlapped
                cut = len({p.doc_id for rank in pieces for p in rank if p.doc_start > 0})
                row = [num_docs, fill, cut, planned.imbalance_before, planned.imbalance_after, planned.moves,
                       seconds, step, seconds / step, statistics.fmean(planned.bytes_sent) / 2**20,
                       max(planned.bytes_sent) / 2**20]  # fmt: skip
                if link is not None:
                    reference = plan(pieces, balance_only)
                    row += [planned.critical_path_before * 1e3, plan_critical_path(reference, link) * 1e3,
                            planned.critical_path_after * 1e3, sim.kv_fanout(reference), sim.kv_fanout(planned)]  # fmt: skip
                rows.append(row)
            med = [statistics.median(c) for c in zip(*rows)]
            line = (
                f"| {world} | {per_rank} | {med[0]:.0f} | {med[1]:.1%} | {med[2]:.0f} | {med[3]:.2f} | {med[4]:.3f} "
                f"| {med[5]:.0f} | {med[6] * 1e3:.1f} | {max(r[6] for r in rows) * 1e3:.1f} | {med[7]:.2f} "
                f"| {med[8]:.2%} | {max(r[8] for r in rows):.2%} | {med[9]:.1f} | {med[10]:.1f} |"
            )
            if link is not None:
                line += f" {med[11]:.1f} | {med[12]:.1f} | {med[13]:.1f} | {med[14]:.0f} | {med[15]:.0f} |"
            print(line, flush=True)


if __name__ == "__main__":
    main()
