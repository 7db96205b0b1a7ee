"""The simulator (benchmarks/simulate.py) against measured training steps on 1 and 2 x H200 (CPU only).

Reads the step times that benchmarks/bench_remat.py measured (markdown files of benchmarks/results/, e.g.
remat_2xh200.md and cudnn_step_2xh200.md), rebuilds from each table's own command the micro-batches that
run trained (common.build_batches on the CPU: the same seeded document draw, the same DistCABatches
layout), plans each with DistCA's planner under the config bench_remat's engine ran
(``DistCAConfig(backend=...)``, everything else default) and prices the plan with the simulator's model
(simulate.price_plan: the torch_varlen kernel table, the linear non-attention fit, the NVLink all-to-all
table, the command's layer count). Prediction of a step: the serial schedule (benchmarks/sim/schedule.py's serial, bench_remat runs without
ping-pong: every rank waits for the slowest at each all-to-all, nothing overlapped) timed by
simulate.price_plan as simulate.simulate prices DistCA's engine; median over
the timed steps as bench_remat reports. Also the forward of core attention alone (all layers) against
the table's 'core-attention forward alone' rows, which isolates the attention and communication part.

Also reads benchmarks/bench_ping_pong.py's tables (sections '## Ping-pong, N x GPU, ...', e.g.
layer_ping_pong_1xh200.md) and prices their ``serial``, ``serial_tight`` and ``layer_ping_pong`` rows: the
micro-batches of its own step_batches as bench_ping_pong.batch_kind gives them per mode (one plan per
micro-batch for serial, laid out at --tokens-per-rank; for serial_tight one plan of the micro-batch laid
out at the fewest tokens per rank that hold it, ``pad_to_budget=False``; for layer_ping_pong the two
nano-batches hf_distca.data.nano splits it into, each laid out at its own tokens per rank and planned on
its own) planned under the mode's DistCAConfig (bench_ping_pong.MODE_CONFIG) with the cost table that
``cost_table="auto"`` resolves to on that GPU for the kernel 'auto' ran, and priced by
simulate.price_plans with that table: the serial schedule for one plan, the layer-level one
(benchmarks/sim/schedule.py's layer_ping_pong) for several, as simulate prices ``distca`` and
``distca-layers``. Tables run with ``--passes 2`` or more have each mode's step time of every pass: the
prediction (which prices no cuDNN plan builds) is compared with the second, warm pass (no new plans: the
steady state) and with the first. The ratios serial / serial_tight (dropped padding), serial /
layer_ping_pong and serial_tight / layer_ping_pong (the nano-batch split by itself) per (sample, tokens
per rank) are what the check is for.

Nothing here is fitted to these measurements: the simulator's constants come from other runs
(kernels_h200.md, the shipped cost tables, the 4-layer straggler and 8-layer fit and the NCCL
all-to-all figures of benchmarks/sim/costs.py).

    python -m benchmarks.check_simulator --results benchmarks/results/remat_2xh200.md \\
        --results benchmarks/results/cudnn_step_2xh200.md --results benchmarks/results/layer_ping_pong_1xh200.md \\
        --doc-lengths prolong=PATH/doclens_prolong.json --doc-lengths pretrain=PATH/doclens_pretrain.json \\
        --out OUT/simulator_check_tables.md

prints (and with ``--out`` writes) the tables of benchmarks/results/simulator_check_2xh200.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

import torch

from hf_distca.config import DistCAConfig, cost_model_from_config
from hf_distca.cost_tables import find_shipped_table
from hf_distca.data.baselines import LAYOUTS
from hf_distca.data.nano import NANO_BATCHES
from hf_distca.planning import plan_core_attention
from hf_distca.planning.links import attention_flops_per_pair

from . import (
    bench_ping_pong,  # its parser, modes and nano-batches per mode
    common,
    sim,
)
from .measured_tables import ATTENTION_ROW, Measured, bench_args, parse_results, ping_pong_args
from .simulate import portable

RECOMPUTE = {"remat": "remat", "recompute": "full"}
"""bench_remat mode -> simulator recompute mode; 'none' (no checkpointing) has no linear fit."""
BACKEND_KERNELS = {"auto": "torch_varlen", "torch_varlen": "torch_varlen"}
"""Backends whose kernel table the simulator has (kernels_h200.md, FA2 varlen; 'auto' chose it on H200)."""
PING_PONG_MODES = ("serial", "serial_tight", "layer_ping_pong")
"""bench_ping_pong modes priced here (the others exchange 1-byte messages or split attention calls)."""
PING_PONG_RATIOS = (
    ("serial", "serial_tight", "dropped padding"),
    ("serial", "layer_ping_pong", "padding and split"),
    ("serial_tight", "layer_ping_pong", "the split by itself"),
)
"""(numerator mode, denominator mode, what the ratio isolates) of the ping-pong ratio table."""


def rebuild_layouts(
    sample: list[int], *, world: int, tokens_per_rank: int, count: int, seed: int, layout: str
) -> list[tuple[tuple[tuple[int, int, int], ...], ...]]:
    """All ranks' pieces of the first ``count`` micro-batches bench_remat trains (its own build_batches,
    on the CPU; every rank's copy holds every rank's pieces, so rank 0's suffices)."""
    batches = common.build_batches(
        sample, tokens_per_rank, count, rank=0, world=world, seed=seed, layout=LAYOUTS[layout],
        device=torch.device("cpu"),
    )  # fmt: skip
    return [b["distca_layout"].all_pieces for b in batches]


def rebuild_nano_layouts(
    sample: list[int],
    tokens_per_rank: int,
    args: argparse.Namespace,
    *,
    world: int,
    nano_batches: int,
    pad_to_budget: bool = True,
) -> list[list[tuple]]:
    """Per micro-batch bench_ping_pong trains with ``nano_batches`` per micro-batch and ``pad_to_budget``
    (bench_ping_pong.batch_kind of a mode; its step_batches, on the CPU, with its parsed ``args``), every
    rank's pieces of each nano-batch (one when it runs whole)."""
    batches = common.step_batches(
        sample, tokens_per_rank, args, rank=0, world=world, device=torch.device("cpu"), nano_batches=nano_batches,
        pad_to_budget=pad_to_budget,
    )  # fmt: skip
    return [[part["distca_layout"].all_pieces for part in b.get(NANO_BATCHES, (b,))] for b in batches]


def shipped_cost_table(device: str, backend: str, model: sim.ModelShape) -> str:
    """Path of the shipped table ``DistCAConfig(cost_table="auto")`` resolves to for bf16 ``model`` heads
    with ``backend`` on ``device`` (hf_distca.engine.cost_probe: on one process, or every rank finding the
    same one): what the engine balanced in the run and what its kernels are priced with here."""
    name = find_shipped_table(device, "bfloat16", model.heads, model.kv_heads, model.head_dim, backend)
    if name is None:
        raise SystemExit(
            f"no shipped cost table for {device}, {backend}: the run's kernel has no measured table"
        )
    return str(resources.files("hf_distca.cost_tables") / name)


def plan_as_engine(all_pieces, model: sim.ModelShape, config: DistCAConfig):
    """The plan DistCA's engine made for these pieces under ``config`` (engine.prepare._planned). The
    bench_remat runs planned causal pairs (they predate ``cost_table="auto"``): ``cost_table=None``."""
    return plan_core_attention(
        [list(p) for p in all_pieces],
        q_row_bytes=model.q_row_bytes,
        kv_row_bytes=model.kv_row_bytes,
        options=config.planner_options(),
        cost_model=cost_model_from_config(config),
        flops_per_pair=attention_flops_per_pair(model.heads, model.head_dim),
    )


@dataclass
class Predicted:
    step_s: float
    """Median over the timed steps of the serial schedule's time (linear + attention + communication when
    the slowest rank is slowest in every stage)."""
    linear_s: float
    attention_s: float
    comm_s: float
    """Medians of the parts (slowest rank each)."""
    sent_gib: float
    """Most GiB one rank sends in one timed step (as bench_remat reports: max over steps and ranks)."""
    imbalance: tuple[float, float]
    """Planned attention imbalance (max / mean causal pairs) before -> after, first timed step (as bench_remat)."""
    attn_forward_s: float
    """Median over the timed steps of the forward of core attention alone, all layers, with its two phases."""


def predict(plans, setting: sim.Setting) -> Predicted:
    """Price the timed steps' plans the way simulate.simulate prices DistCA's engine run serially (the
    serial schedule of benchmarks/sim/schedule.py: bench_remat ran without ping-pong)."""
    parts, forward = [], []
    for plan in plans:
        mb = sim.price_plan(plan, setting)
        parts.append((mb.linear.max(), mb.attention.max(), mb.comm, mb.bytes_sent.max() / 2**30, mb.step_s))
        fwd = [sum(setting.kernels.task_seconds(t.q_len, t.q_end)[0] for t in tasks) for tasks in plan.tasks]
        q, kv = sim.traffic(plan, setting.model.q_row_bytes, setting.model.kv_row_bytes)
        phases = sim.phases(q, kv, "remat")[:2]  # forward dispatch and return
        comm = sum(setting.links.phase_seconds(m) for m in phases)
        forward.append(setting.model.layers * (max(fwd) + comm))
    med = [statistics.median(x) for x in zip(*parts, strict=True)]
    step = statistics.median(p[4] for p in parts)
    first = plans[0]
    imbalance = tuple(max(x) / statistics.fmean(x) for x in (first.pairs_before, first.pairs_after))
    return Predicted(
        step, med[0], med[1], med[2], max(p[3] for p in parts), imbalance, statistics.median(forward)
    )


def check(measured: Sequence[Measured], specs: dict[str, str]) -> list[tuple[Measured, Predicted]]:
    """Every measured row the simulator models, with its prediction (one plan per micro-batch).
    ``specs``: sample name -> bench_remat's --doc-lengths value ('mix' or name=path.json)."""
    out = []
    cache: dict[tuple, list] = {}
    for row in measured:
        if row.tokens_per_rank is not None:  # a bench_ping_pong row: check_ping_pong
            continue
        if row.mode not in (*RECOMPUTE, ATTENTION_ROW) or row.backend not in BACKEND_KERNELS:
            continue
        if row.sample not in specs:
            raise SystemExit(
                f"{row.source}: sample {row.sample!r} has no --doc-lengths here (give name=PATH)"
            )
        args = bench_args(row.command)
        model = dataclasses.replace(sim.ModelShape(), layers=args.layers)
        key = (row.sample, row.world, row.backend, args.layers, args.tokens_per_rank, args.warmup, args.steps,
               args.seed, args.layout)  # fmt: skip
        if key not in cache:
            sample = common.load_lengths(specs[row.sample], args.seed)[1]
            layouts = rebuild_layouts(
                sample, world=row.world, tokens_per_rank=args.tokens_per_rank, count=args.warmup + args.steps,
                seed=args.seed, layout=args.layout,
            )  # fmt: skip
            config = DistCAConfig(backend=row.backend, cost_table=None)
            cache[key] = [plan_as_engine(a, model, config) for a in layouts[args.warmup :]]
        setting = sim.Setting(
            row.world, args.tokens_per_rank, model, sim.KernelTable.from_kernel_rows(), sim.Links(),
            sim.LinearCost.from_measurements(), RECOMPUTE.get(row.mode, "remat"),
        )  # fmt: skip
        out.append((row, predict(cache[key], setting)))
    return out


@dataclass
class PingPongPredicted:
    """The simulator's figures of one bench_ping_pong row (medians over the timed steps)."""

    step_s: float
    """Schedule time: serial for one plan, layer-level ping-pong for two nano-batches."""
    linear_s: float
    attention_s: float
    comm_s: float
    """Parts, slowest rank, summed over a micro-batch's nano-batches."""
    tokens_per_rank: float
    """Tokens computed per rank, padding included (a nano-batch is laid out at its own tokens per rank)."""
    fwd_kernels: int
    """Attention forward kernel runs per step: layers x the most plans of a timed micro-batch."""
    last_step_s: float
    """Schedule time of the last timed micro-batch (the one bench_ping_pong profiles)."""


def predict_ping_pong(micro_batches: Sequence[Sequence], setting: sim.Setting) -> PingPongPredicted:
    """Price each micro-batch's plans (one per nano-batch) with simulate.price_plans, as
    simulate.simulate_micro_batch prices ``distca-layers``: several plans on the layer-level schedule, one
    (serial mode, or a micro-batch too small to split) on the serial schedule."""
    priced = [
        sim.price_plans(plans, setting, "layers" if len(plans) > 1 else "serial") for plans in micro_batches
    ]
    tokens = [
        sum(t.q_len for plan in plans for tasks in plan.tasks for t in tasks) / setting.world
        for plans in micro_batches
    ]
    return PingPongPredicted(
        statistics.median(mb.step_s for mb in priced),
        statistics.median(float(mb.linear.max()) for mb in priced),
        statistics.median(float(mb.attention.max()) for mb in priced),
        statistics.median(mb.comm for mb in priced),
        statistics.median(tokens),
        setting.model.layers * max(len(plans) for plans in micro_batches),
        priced[-1].step_s,
    )


def check_ping_pong(
    measured: Sequence[Measured], specs: dict[str, str]
) -> list[tuple[Measured, PingPongPredicted]]:
    """Every bench_ping_pong row of PING_PONG_MODES with its prediction: the timed micro-batches of the
    row's mode rebuilt (bench_ping_pong.batch_kind: nano-batches and padding per mode), planned under the mode's DistCAConfig
    and the run's cost table, priced with that table and the linear fit at the command's layer count.
    ``specs``: sample name -> --doc-lengths value."""
    out = []
    for row in measured:
        if row.tokens_per_rank is None or row.mode not in PING_PONG_MODES:
            continue
        if row.sample not in specs:
            raise SystemExit(
                f"{row.source}: sample {row.sample!r} has no --doc-lengths here (give name=PATH)"
            )
        args = ping_pong_args(row.command)
        if args.model != "llama3-8b-shaped" or args.checkpointing != "remat":
            raise SystemExit(f"{row.source}: the simulator models llama3-8b-shaped with remat checkpointing")
        model = dataclasses.replace(sim.ModelShape(), layers=args.layers)
        table = shipped_cost_table(row.device, row.backend, model)
        config = DistCAConfig(backend=args.backend, cost_table=table, **bench_ping_pong.MODE_CONFIG[row.mode])
        sample = common.load_lengths(specs[row.sample], args.seed)[1]
        nano_batches, pad_to_budget = bench_ping_pong.batch_kind(row.mode)
        layouts = rebuild_nano_layouts(
            sample, row.tokens_per_rank, args, world=row.world, nano_batches=nano_batches,
            pad_to_budget=pad_to_budget,
        )  # fmt: skip
        plans = [[plan_as_engine(p, model, config) for p in nanos] for nanos in layouts[args.warmup :]]
        setting = sim.Setting(
            row.world, row.tokens_per_rank, model, sim.KernelTable.from_json(table), sim.Links(),
            sim.LinearCost.from_measurements(),
        )  # fmt: skip
        out.append((row, predict_ping_pong(plans, setting)))
    return out


def _error(predicted: float, measured: float | None) -> str:
    return "" if measured is None else f"{100 * (predicted - measured) / measured:+.1f}%"


def ping_pong_report(pairs: Sequence[tuple[Measured, PingPongPredicted]]) -> list[str]:
    """The ping-pong tables (markdown lines): per row measured (second pass where the table has one, and
    first) vs predicted, then the ratios of PING_PONG_RATIOS."""
    if not pairs:
        return []

    def setting(row: Measured) -> str:
        size = f"{row.tokens_per_rank // 1024}K" if row.tokens_per_rank >= 1024 else f"{row.tokens_per_rank}"
        return f"{row.sample} / {size}, {row.world} x {row.device}, {row.backend} table"

    def seconds(value: float | None) -> str:
        return "" if value is None else f"{value:.3f}"

    lines = [
        "",
        "bench_ping_pong's modes on the same documents (predicted: simulate.price_plans, the serial schedule for "
        "one plan, the layer-level one for two nano-batches; measured: the second pass, every shape seen once "
        "and no cuDNN plan built, and the first pass, which builds them; the simulator prices no plan builds):",
        "",
        "| setting | file | mode | measured s: 2nd pass | 1st pass | predicted s | error vs 2nd pass "
        "| error vs 1st pass | cuDNN plans built per pass | predicted linear / attention / comm s "
        "| predicted tokens / rank | attn fwd kernels / step: measured / predicted "
        "| profiled step (last micro-batch): kernel span / predicted s |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---|---:|---|---|",
    ]
    for row, pred in pairs:
        span = row.profiled_span_s
        profiled = (
            "" if span is None else f"{span:.3f} / {pred.last_step_s:.3f} ({_error(pred.last_step_s, span)})"
        )
        lines.append(
            f"| {setting(row)} | {os.path.basename(row.source)} | {row.mode} | {seconds(row.warm_s)} "
            f"| {row.seconds:.3f} | {pred.step_s:.3f} | {_error(pred.step_s, row.warm_s)} "
            f"| {_error(pred.step_s, row.seconds)} | {' / '.join(str(n) for n in row.plans_built)} "
            f"| {pred.linear_s:.3f} / {pred.attention_s:.3f} / {pred.comm_s:.3f} | {pred.tokens_per_rank:.0f} "
            f"| {row.fwd_kernels} / {pred.fwd_kernels} | {profiled} |"
        )
    lines += [
        "",
        "| setting | file | ratio (what it isolates) | measured: 2nd pass | 1st pass | predicted "
        "| error vs 2nd pass | error vs 1st pass |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    by_key = {(r.source, r.world, r.sample, r.tokens_per_rank, r.mode): (r, p) for r, p in pairs}
    settings = list(dict.fromkeys(key[:4] for key in by_key))
    for key in settings:
        for top, bottom, what in PING_PONG_RATIOS:
            a, b = by_key.get((*key, top)), by_key.get((*key, bottom))
            if a is None or b is None:
                continue
            (ra, pa), (rb, pb) = a, b
            warm = ra.warm_s / rb.warm_s if ra.warm_s is not None and rb.warm_s is not None else None
            first, predicted = ra.seconds / rb.seconds, pa.step_s / pb.step_s
            lines.append(
                f"| {setting(ra)} | {os.path.basename(ra.source)} | {top} / {bottom} ({what}) | {seconds(warm)} "
                f"| {first:.3f} | {predicted:.3f} | {_error(predicted, warm)} | {_error(predicted, first)} |"
            )
    return lines


def portable_command(argv: Sequence[str]) -> str:
    """The command with the directories of ``--doc-lengths name=PATH`` files replaced by ``<shared data>``."""
    words, before = [], ""
    for arg in argv:
        spec = before == "--doc-lengths" or arg.startswith("--doc-lengths=")
        words.append(portable(arg, "<shared data>") if spec else arg)
        before = arg
    return "python -m benchmarks.check_simulator " + " ".join(shlex.quote(w) for w in words)


def _setting(row: Measured) -> str:
    link = ", NVLink" if row.world > 1 else ""
    return f"{row.sample}, {row.world} GPU{'s' if row.world > 1 else ''}{link}"


def report(
    pairs: list[tuple[Measured, Predicted]],
    command: str,
    ping_pong: Sequence[tuple[Measured, PingPongPredicted]] = (),
) -> str:
    """The comparison tables (markdown); ``ping_pong``: the bench_ping_pong rows' (see ping_pong_report)."""
    lines = [
        "| setting | file | measured s | predicted s | error | predicted linear / attention / comm s "
        "| GiB sent / step: measured / predicted | imbalance before -> after: measured / predicted |",
        "|---|---|---:|---:|---:|---|---|---|",
    ]
    for row, pred in pairs:
        if row.mode == ATTENTION_ROW:
            setting = f"{_setting(row)}, core-attention forward alone (all layers)"
            value, parts, sent, imbalance = pred.attn_forward_s, "", "", ""
        else:
            setting = f"{_setting(row)}, {row.mode}"
            value = pred.step_s
            parts = f"{pred.linear_s:.3f} / {pred.attention_s:.3f} / {pred.comm_s:.3f}"
            sent = f"{row.sent_gib:.2f} / {pred.sent_gib:.2f}"
            imbalance = "{:.2f} -> {:.2f} / {:.2f} -> {:.2f}".format(*row.imbalance, *pred.imbalance)
        error = 100 * (value - row.seconds) / row.seconds
        lines.append(
            f"| {setting} | {os.path.basename(row.source)} | {row.seconds:.3f} | {value:.3f} | {error:+.1f}% "
            f"| {parts} | {sent} | {imbalance} |"
        )
    lines += [
        "",
        "Differences between two samples' steps on the same GPUs, same mode and file (the linear part, the "
        "same 64K tokens per rank in both, cancels: what is left is attention and communication):",
        "",
        "| file | GPUs | mode | samples | measured s | predicted s | error |",
        "|---|---:|---|---|---:|---:|---:|",
    ]
    steps = [(r, p) for r, p in pairs if r.mode != ATTENTION_ROW]
    for i, (a, pa) in enumerate(steps):
        for b, pb in steps[i + 1 :]:
            if (a.source, a.world, a.mode, a.backend) != (b.source, b.world, b.mode, b.backend):
                continue
            measured, predicted = a.seconds - b.seconds, pa.step_s - pb.step_s
            lines.append(
                f"| {os.path.basename(a.source)} | {a.world} | {a.mode} | {a.sample} - {b.sample} | {measured:.3f} "
                f"| {predicted:.3f} | {100 * (predicted - measured) / measured:+.1f}% |"
            )
    lines += [*ping_pong_report(ping_pong), "", f"Command: `{command}`"]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--results",
        action="append",
        required=True,
        help="a bench_remat or bench_ping_pong markdown file (repeatable)",
    )
    p.add_argument(
        "--doc-lengths", action="append", default=[], help="name=path.json of a sample the tables name "
        "(as bench_remat's; 'mix' is generated)",
    )  # fmt: skip
    p.add_argument("--out", default=None, help="also write the comparison tables to this file")
    args = p.parse_args(argv)
    measured = []
    for path in args.results:
        with open(path) as f:
            measured += parse_results(f.read(), path)
    specs = {"mix": "mix"} | {s.partition("=")[0]: s for s in args.doc_lengths}
    command = portable_command(sys.argv[1:] if argv is None else argv)
    table = report(check(measured, specs), command, check_ping_pong(measured, specs))
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    print(table)
    return table


if __name__ == "__main__":
    main()
