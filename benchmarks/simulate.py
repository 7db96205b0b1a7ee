"""Simulated step times of DistCA and its baselines on 2-512 GPUs, from measured kernel and link tables.

Replays the global batches a recipe run would train (benchmarks/workloads.py: same seed, same documents
for every system) on N GPUs (``--gpus-per-node`` per node, NVLink inside a node, a stated inter-node
bandwidth per GPU) and prices every rank's work:

- systems (how each is run through recipes/finetune_long_docs.py is in benchmarks/suite.py):
  ``hf-default`` (hf_distca.data.baselines.hf_default_layout, attention local to each piece: documents
  longer than a rank's budget become independent chunks, the math differs), ``exact-unbalanced`` (the
  token-only rebatcher layout, hf_distca.data.layout_pieces, DistCA's engine with balancing off,
  ``DistCAConfig(max_planner_moves=0)``: each rank computes its own pieces, fetching the KV prefix of
  pieces cut over ranks), ``balanced`` (WLB-LLM-style balanced packing, hf_distca.data.layout_balanced,
  run like exact-unbalanced: DistCA's layout without its planner), ``distca`` (DistCA's default: the
  balanced layout and the real planner, ``hf_distca.plan_core_attention``, ``--tolerance``, default
  DistCAConfig's: 0.1 for it, 0.02 for the planners that price communication; balancing compute only),
  ``distca-comm`` (the same planner pricing communication on the simulated links:
  ``DistCAConfig(link_gib_per_s=--inter-node-gibps, ranks_per_node=--gpus-per-node,
  intra_node_gib_per_s=the intra-node all-to-all at 256 MiB per rank)``, see :func:`planner_config`,
  and the layout DistCACallback builds from that config: documents cut inside one node; under layer-level
  ping-pong also ``layer_ping_pong=True`` with ``layer_seconds_per_token`` derived as
  :func:`hf_distca.enable_distca` derives it, from the layer's weights at the default ``layer_tflops``:
  the planner prices transfers as hidden behind the other nano-batch's layers),
  ``distca-pingpong`` / ``distca-comm-pingpong`` (those plans under attention-level ping-pong,
  ``DistCAConfig(ping_pong=True)``: the engine's nano-batches inside each attention call,
  hf_distca.planning.ping_pong) and ``distca-layers`` / ``distca-comm-layers`` (layer-level ping-pong: the
  micro-batch's whole documents in two nano-batches of about equal estimated cost, each laid out over all
  ranks at its own tokens per rank (the fewest that hold it) and planned on its own, as the data path does:
  :func:`hf_distca.data.nano.split_documents` and :func:`~hf_distca.data.nano.nano_tokens_per_rank`; a
  micro-batch of one document runs whole, serial; run through the layers as coroutines that switch at the
  attention function). Not run by default (``--systems``): ``distca-comm-layers4`` (4 nano-batches),
  ``-shard1k`` (1024-token shards) and ``-exposed`` (the planner prices every transfer exposed).
  ``distca-comm-layers-relay``: distca-comm-layers with ``DistCAConfig(kv_relay=True)``, KV rows
  crossing nodes once per destination node through a relay rank (:mod:`hf_distca.planning.relay`; each
  phase that carries KV is two all-to-alls, back to back, as the engine chains them).
- padding: the systems through DistCA's data path (all but hf-default) lay out a micro-batch that runs
  whole at the fewest tokens per rank that hold it, as ``DistCAConfig.pad_to_budget=False`` (the default)
  makes ``DistCABatches`` do, and as nano-batches always are; ``--pad-to-budget``: at ``--tokens-per-rank``
  (padding runs through the non-attention work). hf-default packs to the budget.
- core attention: every CA-task (queries [a, b) of a document over keys [0, b)) costs its causal
  (query, key) pairs over the measured rate of its shape, per layer: forward + backward (the
  ``remat`` recompute mode, rematerialization-aware checkpointing: attention is not run again) or
  forward twice + backward (``full``: plain activation recompute). Kernel table: the figures of
  benchmarks/results/kernels_h200.md (whole documents of 512-32K tokens; a task's rate is taken as
  the measured rate of whole documents as long as its query shard, so short shards over long prefixes
  are priced conservatively; the forward alone from the measured forward times), or ``--kernel-table``,
  a JSON table written by ``python -m hf_distca.calibrate`` (q_len x kv_len -> seconds of a task,
  forward+backward; the forward alone is then taken as 1/3.5 of it, the FLOP ratio), e.g. the shipped
  hf_distca/cost_tables/h200_bf16_32x8x128_torch_varlen.json. With such a table the DistCA systems also
  plan with it, as the engine does on an H200 (``DistCAConfig(cost_table="auto")``: measured kernel time,
  not pairs); with the whole-document rows they plan causal pairs (:func:`planner_config`).
- everything else (projections, MLP, norms, LM head and loss, optimizer), linear in tokens:
  ``layers x per_layer + fixed`` seconds per token, fitted to this project's H200 measurements
  (the H200 measurements of benchmarks/sim/costs.py: a 4-layer Llama-3-8B-shaped stack took 1.33 / 1.52 / 2.23 / 3.18 s
  for 64K tokens as 32 x 2K / 8 x 8K / 2 x 32K / 1 x 64K documents with gradient checkpointing; minus
  the kernel table's attention (forward twice + backward) that leaves ~1.26 s for every mix; and an
  8-layer run's non-attention part was ~2.3 s per 64K tokens): ~3.97 us per token per layer plus
  ~3.4 us per token, with activation checkpointing (overridable).
- communication (DistCA's engine: all-to-all-v per layer; bytes per the traffic ledger,
  hf_distca.planning.traffic: forward Q +
  KV out and outputs back, backward Q, output, output gradient, KV out and dQ, dK, dV back; plain
  recompute adds another forward): each all-to-all phase lasts as long as its slowest rank, whose
  NVLink traffic (per-rank volume -> GiB/s interpolated in log-log from the measured 2-GPU NCCL
  all-to-all, ~140 / 260 / 307 GiB/s at 16 MiB / 256 MiB / 1 GiB, extrapolated below 16 MiB along the
  first segment) and inter-node traffic (flat ``--inter-node-gibps``) proceed at the same time.
  ``--intra-link host`` prices the 2-GPU link as measured with ``NCCL_P2P_DISABLE=1`` (~22 GiB/s).
- step time: the engine's schedule of each micro-batch (benchmarks/sim/schedule.py: serial, attention-level
  or layer-level ping-pong; per layer, forward and backward, the non-attention work before attention (norm,
  QKV, RoPE: its share of the layer's matmul weights) and after it (o_proj, MLP), the four all-to-all
  phases of each nano-batch and part, the server kernels), timed by its list scheduler: per rank one compute
  stream and one communication channel, every all-to-all a collective that starts once every rank has
  started it (and the previous one has ended) and lasts as long as its slowest rank; a wait blocks the
  compute stream. What stays exposed is whatever the schedule leaves uncovered (the first dispatch, the last
  return, phases longer than the work beside them). Non-attention work of a layer: ``FORWARD_SHARE`` of it
  in forward, the rest (recompute and backward) in backward. Summed over micro-batches; ``hf-default`` only
  synchronises at the gradient reduction: max over ranks of its summed work. Gradient all-reduce is the same
  for every system and left out. The serial schedule is what benchmarks/check_simulator.py checks against
  the 1-2 GPU measurements.
- ideal bound: perfect balance and no exposed communication: the exact computation's total work of the
  real tokens (:func:`ideal_work`: no padding, every document's attention whole in one kernel) divided by
  the number of GPUs. Padding (a micro-batch's, or under layer-level ping-pong each nano-batch's, tokens
  per rank beyond its documents) is work of the system, in its 'kernels' part of the gap.
- MFU: model FLOPs of the step (6 x matmul parameters per real token, plus causal attention 3 x 4 x
  heads x head_dim per (query, key) pair per layer, exact for every system) over step time x GPUs x
  989 TFLOP/s. tokens/s counts real (not padding) tokens.

    python -m benchmarks.simulate --workload pretrain=PATH/doclens_pretrain.json \\
        --workload prolong=PATH/doclens_prolong.json --workload long-mix --gpus 2 8 64 512 \\
        --tokens-per-rank 32768 65536 --out benchmarks/results/DATE-simulated.md

Writes the markdown file and a PNG next to it (same name, ``.png``). These are simulated figures.

The parts, one idea each, in benchmarks/sim/: costs.py (the model's shape and the measured kernel, link
and non-attention tables), systems.py (the systems and how each lays out and plans a micro-batch),
schedule.py (the engine's schedules as data and the list scheduler that times them), pricing.py (a
micro-batch priced on its schedule, a step's systems averaged), report.py (the markdown report and the
plot); benchmarks/workloads.py replays the recipe's documents and batches. This module runs the grid of
settings and holds the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import time
from collections.abc import Sequence

from hf_distca.planning.options import BALANCE_ONLY_TOLERANCE, PRICED_TOLERANCE

from .sim.costs import (
    HOST_STAGED_GIBPS,
    NVLINK_ALL_TO_ALL,
    KernelTable,
    LinearCost,
    Links,
    ModelShape,
    Setting,
)
from .sim.pricing import simulate
from .sim.report import Row, plot, write_report
from .sim.systems import EXPLORATIONS, SYSTEMS
from .workloads import documents_for, draw_lengths, global_batches, load_sample


def run_grid(args, log=print) -> tuple[list[Row], dict]:
    model = dataclasses.replace(ModelShape(), layers=args.layers)
    kernels = (
        KernelTable.from_json(args.kernel_table) if args.kernel_table else KernelTable.from_kernel_rows()
    )
    if args.linear_us_per_token_layer is not None:
        linear = LinearCost(args.linear_us_per_token_layer * 1e-6, args.linear_us_per_token_fixed * 1e-6)
    else:
        linear = LinearCost.from_measurements()
    intra = ((1.0, HOST_STAGED_GIBPS),) if args.intra_link == "host" else NVLINK_ALL_TO_ALL
    tasks = []
    for spec in args.workload:
        name, sample = load_sample(spec, seed=args.seed)
        for tokens_per_rank in args.tokens_per_rank:
            for world in args.gpus:
                tokens_per_step = world * tokens_per_rank * args.grad_accum
                count = args.num_documents or documents_for(sample, args.steps, tokens_per_step)
                lengths = draw_lengths(sample, count, args.seed)
                steps = global_batches(
                    lengths, world_size=world, tokens_per_rank=tokens_per_rank, grad_accum=args.grad_accum,
                    seed=args.seed, steps=args.steps,
                )  # fmt: skip
                bandwidths = args.inter_node_gibps if world > args.gpus_per_node else [None]
                settings = []
                for inter in bandwidths:
                    links = Links(args.gpus_per_node, intra, inter or args.inter_node_gibps[0])
                    settings.append((inter, Setting(world, tokens_per_rank, model, kernels, links, linear,
                                                    args.recompute, args.grad_accum, args.pad_to_budget)))  # fmt: skip
                tasks.append((name, tokens_per_rank, world, steps, settings, args.systems, args.tolerance))
    if args.jobs > 1:  # settings in parallel processes (forked: the tables come along), rows in order
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            per_task = pool.map(_run_setting, tasks, chunksize=1)
    else:
        per_task = [_run_setting(task) for task in tasks]
    rows = [row for task_rows in per_task for row in task_rows]
    for row in rows:
        log(f"{row.workload} {row.tokens_per_rank} x {row.world} GPUs, inter {row.inter_gibps}: "
            + ", ".join(f"{k} {r.step_s:.2f}s" for k, r in row.results.items()))  # fmt: skip
    info = {
        "model": model,
        "kernels": kernels.source,
        "linear": linear,
        "intra": intra,
        "planner_table": kernels.path is not None,
    }
    return rows, info


def _run_setting(task) -> list[Row]:
    """The rows of one workload, token budget and GPU count (one per inter-node bandwidth; the plans that
    do not depend on the links are made once)."""
    name, tokens_per_rank, world, steps, settings, systems, tolerance = task
    rows = []
    for inter, setting in settings:
        began = time.perf_counter()
        results = simulate(systems, steps, setting, tolerance)
        rows.append(Row(name, tokens_per_rank, world, inter, results))
        print(
            f"[{time.perf_counter() - began:.0f} s] {name} {tokens_per_rank} x {world}, inter {inter}",
            flush=True,
        )
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--workload",
        action="append",
        required=True,
        help="'long-mix', a JSON file of document lengths, or name=FILE; repeat for several",
    )
    p.add_argument("--gpus", type=int, nargs="+", default=[2, 8, 64, 512])
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--tokens-per-rank", type=int, nargs="+", default=[32768, 65536])
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps simulated per setting")
    p.add_argument("--jobs", type=int, default=1, help="settings simulated in parallel processes")
    p.add_argument("--seed", type=int, default=0, help="document draw and shuffle (as the recipe's --seed)")
    p.add_argument(
        "--num-documents",
        type=int,
        default=None,
        help="documents drawn (as the recipe's --num-documents); default: enough for --steps",
    )
    p.add_argument("--systems", nargs="+", choices=SYSTEMS + EXPLORATIONS, default=list(SYSTEMS))
    p.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="planner tolerance of the distca systems (DistCAConfig.tolerance; default: DistCAConfig's, "
        f"{BALANCE_ONLY_TOLERANCE:g} balance-only, {PRICED_TOLERANCE:g} when communication is priced)",
    )
    p.add_argument(
        "--headline",
        choices=[k for k in SYSTEMS + EXPLORATIONS if k.startswith("distca")],
        default="distca",
        help="the DistCA system of the goal table (DistCA's default settings)",
    )
    p.add_argument("--layers", type=int, default=32)
    p.add_argument(
        "--pad-to-budget",
        action="store_true",
        help="DistCA's data path pads each whole micro-batch to --tokens-per-rank (DistCAConfig.pad_to_budget)",
    )
    p.add_argument("--recompute", choices=("remat", "full"), default="remat")
    p.add_argument("--kernel-table", default=None, help="JSON from python -m hf_distca.calibrate")
    p.add_argument(
        "--inter-node-gibps", type=float, nargs="+", default=[23.3, 46.6], help="per GPU, one row each"
    )
    p.add_argument(
        "--intra-link",
        choices=("nvlink", "host"),
        default="nvlink",
        help="host: the 2-GPU all-to-all as measured with NCCL_P2P_DISABLE=1",
    )
    p.add_argument("--linear-us-per-token-layer", type=float, default=None, help="override the fit")
    p.add_argument("--linear-us-per-token-fixed", type=float, default=0.0)
    p.add_argument("--out", default=None, help="markdown file to write (a PNG of the same name beside it)")
    return p


def portable(arg: str, placeholder: str = "<data>") -> str:
    """A command-line argument with the directory of an absolute file path replaced by ``placeholder``
    (results files name no machine's paths)."""
    name, sep, path = arg.rpartition("=")
    if os.path.isabs(path):
        return f"{name}{sep}{placeholder}/{os.path.basename(path)}"
    return arg


def main(argv: Sequence[str] | None = None) -> list[Row]:
    args = build_parser().parse_args(argv)
    for name in ("gpus", "tokens_per_rank"):
        if min(getattr(args, name)) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    rows, info = run_grid(args)
    argv = list(argv if argv is not None else sys.argv[1:])
    command = "python -m benchmarks.simulate " + " ".join(shlex.quote(portable(a)) for a in argv)
    report = write_report(rows, info, args, command)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
        plot(rows, os.path.splitext(args.out)[0] + ".png")
        print(f"wrote {args.out} and {os.path.splitext(args.out)[0]}.png")
    else:
        print(report)
    return rows


if __name__ == "__main__":
    main()
