"""The simulator (benchmarks/simulate.py) against measured training steps on 1 and 2 x H200 (CPU only).

Reads the step times that benchmarks/bench_remat.py measured (markdown files of benchmarks/results/, e.g.
remat_2xh200.md and cudnn_step_2xh200.md), rebuilds from each table's own command the micro-batches that
run trained (common.build_batches on the CPU: the same seeded document draw, the same DistCABatches
layout), plans each with DistCA's planner under the config bench_remat's engine ran
(``DistCAConfig(backend=...)``, everything else default) and prices the plan with the simulator's model
(simulate.price_plan: the torch_varlen kernel table, the linear non-attention fit, the NVLink all-to-all
table, the command's layer count). Prediction of a step: the serial schedule (hf_distca.planning.schedule.serial, bench_remat runs without
ping-pong: every rank waits for the slowest at each all-to-all, nothing overlapped) timed by
simulate.price_plan as simulate.simulate prices DistCA's engine; median over
the timed steps as bench_remat reports. Also the forward of core attention alone (all layers) against
the table's 'core-attention forward alone' rows, which isolates the attention and communication part.

Nothing here is fitted to these measurements: the simulator's constants come from other runs
(kernels_h200.md, DESIGN.md's 4-layer straggler and 8-layer fit, the NCCL all-to-all figures).

    python benchmarks/check_simulator.py --results benchmarks/results/remat_2xh200.md \\
        --results benchmarks/results/cudnn_step_2xh200.md --doc-lengths prolong=PATH/doclens_prolong.json \\
        --out OUT/simulator_check_tables.md

prints (and with ``--out`` writes) the tables of benchmarks/results/simulator_check_2xh200.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_remat  # noqa: E402  (its command-line parser: the results tables hold its commands)
import common  # noqa: E402
import simulate as sim  # noqa: E402

from hf_distca.config import DistCAConfig  # noqa: E402
from hf_distca.data.baselines import LAYOUTS  # noqa: E402
from hf_distca.planning import plan_core_attention  # noqa: E402
from hf_distca.planning.cost import cost_model_from_config  # noqa: E402
from hf_distca.planning.links import attention_flops_per_pair  # noqa: E402

RECOMPUTE = {"remat": "remat", "recompute": "full"}
"""bench_remat mode -> simulator recompute mode; 'none' (no checkpointing) has no linear fit."""
ATTENTION_ROW = "core-attention forward alone, all layers"
BACKEND_KERNELS = {"auto": "torch_varlen", "torch_varlen": "torch_varlen"}
"""Backends whose kernel table the simulator has (kernels_h200.md, FA2 varlen; 'auto' chose it on H200)."""


@dataclass(frozen=True)
class Measured:
    """One measured row of a bench_remat table."""

    source: str
    """File the row comes from."""
    world: int
    sample: str
    """Length sample name ('mix', 'prolong', ...)."""
    mode: str
    """Checkpointing mode ('remat', 'recompute', 'none') or ATTENTION_ROW."""
    backend: str
    """Kernel backend of the run ('auto' when the table names none)."""
    seconds: float
    sent_gib: float | None
    """Core-attention bytes sent per step (GiB, max over ranks and steps); None for the attention-alone row."""
    imbalance: tuple[float, float] | None
    """Attention imbalance before -> after the plan (first timed step); None for the attention-alone row."""
    command: str
    """The table's bench_remat command."""


_HEADER = re.compile(r"^## Checkpointing modes, (\d+) x ")
_COMMAND = re.compile(r"^Command: `(.*)`\s*$")


def parse_results(text: str, source: str) -> list[Measured]:
    """Every timed row of the bench_remat tables in ``text`` (sections '## Checkpointing modes, N x ...')."""
    rows: list[Measured] = []
    world = command = None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            world, command = int(header.group(1)), None
            continue
        if line.startswith("## "):
            world = None
            continue
        found = _COMMAND.match(line)
        if found and world is not None:
            command = found.group(1)
            continue
        if world is None or command is None or not line.startswith("| ") or line.startswith("| sample"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        try:
            seconds = float(cells[2])
        except ValueError:  # out of memory / not run
            continue
        sample = cells[0].split(" (")[0]
        mode, backend = cells[1], "auto"
        if mode.endswith(")") and " (" in mode:
            mode, backend = mode[:-1].split(" (")
        sent = imbalance = None
        if mode != ATTENTION_ROW:
            sent = float(cells[6])
            imbalance = tuple(float(x) for x in cells[7].split("->"))
        rows.append(Measured(source, world, sample, mode, backend, seconds, sent, imbalance, command))
    return rows


def bench_args(command: str) -> argparse.Namespace:
    """The bench_remat options of a table's command that decide which micro-batches ran."""
    words = shlex.split(command)
    words = words[next(i for i, w in enumerate(words) if w.endswith("bench_remat.py")) + 1 :]
    p = bench_remat.build_parser()
    args, _ = p.parse_known_args(words)
    return args


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


def plan_as_engine(all_pieces, model: sim.ModelShape, backend: str):
    """The plan DistCA's engine made for these pieces under bench_remat's config (engine.prepare._planned)
    in the measured runs, which planned causal pairs (they predate ``cost_table="auto"``)."""
    config = DistCAConfig(backend=backend, cost_table=None)
    return plan_core_attention(
        [list(p) for p in all_pieces],
        q_row_bytes=model.q_row_bytes,
        kv_row_bytes=model.kv_row_bytes,
        config=config,
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
    serial schedule of hf_distca.planning.schedule: bench_remat ran without ping-pong)."""
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
            cache[key] = [plan_as_engine(a, model, row.backend) for a in layouts[args.warmup :]]
        setting = sim.Setting(
            row.world, args.tokens_per_rank, model, sim.KernelTable.from_kernel_rows(), sim.Links(),
            sim.LinearCost.from_measurements(), RECOMPUTE.get(row.mode, "remat"),
        )  # fmt: skip
        out.append((row, predict(cache[key], setting)))
    return out


def portable_command(argv: Sequence[str]) -> str:
    """The command with the directories of ``--doc-lengths name=PATH`` files replaced by ``<shared data>``."""
    words = [sim.portable(arg, "<shared data>") for arg in argv]
    return "python benchmarks/check_simulator.py " + " ".join(shlex.quote(w) for w in words)


def _setting(row: Measured) -> str:
    link = ", NVLink" if row.world > 1 else ""
    return f"{row.sample}, {row.world} GPU{'s' if row.world > 1 else ''}{link}"


def report(pairs: list[tuple[Measured, Predicted]], command: str) -> str:
    """The comparison tables (markdown)."""
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
    lines += ["", f"Command: `{command}`"]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--results", action="append", required=True, help="a bench_remat markdown file (repeatable)"
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
    table = report(check(measured, specs), portable_command(sys.argv[1:] if argv is None else argv))
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    print(table)
    return table


if __name__ == "__main__":
    main()
