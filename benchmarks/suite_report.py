"""The report of benchmarks/suite.py: each run's measured figures beside the simulator's prediction of the
same batches, per workload and token budget, with plots."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import shlex
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from . import sim
from .simulate import portable
from .suite_runs import NOT_EXACT, SIMULATED_AS, SYSTEM_RUNS, Run, read_metrics, stale
from .workloads import documents_for, draw_lengths, global_batches


@dataclass
class Measured:
    """Figures of one run from its metrics.jsonl and summary.json."""

    steps: int
    step_s: float
    """Median step time (slowest rank) after the warm-up steps."""
    tokens_per_s: float
    mfu: float
    first_loss: float
    imbalance_after: float
    sent_gib_max: float | None
    """GiB sent per step by the busiest rank (mean over the measured steps); None when the run counts none."""
    peak_memory_gib: float | None


def measure(
    out_dir: str, steps: list[list[list[int]]], model: sim.ModelShape, gpus: int, skip: int
) -> Measured:
    """``steps``: the run's steps (micro-batches of document lengths), as the simulator replays them."""
    records = read_metrics(out_dir)
    timed = [r for r in records if r["step"] > skip]
    if not timed:
        raise ValueError(
            f"stopped early: {len(records)} step(s) recorded, none after the {skip} warm-up steps"
        )
    tokens = [sum(n for mb in steps[r["step"] - 1] for n in mb) for r in timed]
    flops = [model.model_flops([n for mb in steps[r["step"] - 1] for n in mb]) for r in timed]
    seconds = [r["step_time_s"] for r in timed]
    peak = None
    summary = os.path.join(out_dir, "summary.json")
    if os.path.exists(summary):
        with open(summary) as f:
            per_rank = json.load(f).get("peak_memory_gib")
        peak = max(per_rank) if per_rank else None
    return Measured(
        steps=len(records),
        step_s=statistics.median(seconds),
        tokens_per_s=sum(tokens) / sum(seconds),
        mfu=sum(flops) / (sum(seconds) * gpus * sim.PEAK_TFLOPS * 1e12),
        first_loss=records[0]["loss"],
        imbalance_after=statistics.fmean(r["imbalance_after"] for r in timed),
        sent_gib_max=(
            statistics.fmean(max(r["bytes_sent"]) for r in timed) / 2**30
            if all("bytes_sent" in r for r in timed)
            else None  # torch-cp: its ring exchanges are not counted
        ),
        peak_memory_gib=peak,
    )


def predict(args, sample: list[int], tokens_per_rank: int, systems: Sequence[str]):
    """(steps, simulator results) for the batches a run of this workload trains."""
    model = dataclasses.replace(sim.ModelShape(), layers=args.layers)
    kernels = (
        sim.KernelTable.from_json(args.kernel_table)
        if args.kernel_table
        else sim.KernelTable.from_kernel_rows()
    )
    intra = ((1.0, sim.HOST_STAGED_GIBPS),) if args.link == "host" else sim.NVLINK_ALL_TO_ALL
    links = sim.Links(gpus_per_node=max(args.gpus, 1), intra=intra)
    linear = sim.LinearCost.from_measurements()
    setting = sim.Setting(args.gpus, tokens_per_rank, model, kernels, links, linear, recompute=args.recompute)
    lengths = draw_lengths(sample, documents_for(sample, args.steps, args.gpus * tokens_per_rank), args.seed)
    steps = global_batches(lengths, world_size=args.gpus, tokens_per_rank=tokens_per_rank, grad_accum=1,
                           seed=args.seed, steps=args.steps)  # fmt: skip
    simulated = sorted({SIMULATED_AS.get(s, s) for s in systems} - {None} | {"exact-unbalanced"})
    measured_steps = steps[args.skip :]
    return steps, sim.simulate(simulated, measured_steps, setting), model


def versions() -> str:
    import importlib.metadata as md

    parts = [f"Python {platform.python_version()}"]
    for package in ("torch", "transformers", "accelerate", "trl", "liger-kernel", "deepspeed", "datasets"):
        try:
            parts.append(f"{package} {md.version(package)}")
        except md.PackageNotFoundError:
            parts.append(f"{package} (not installed)")
    return ", ".join(parts)


def gpu_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return "no GPU visible to the report writer"


def write_report(
    args, runs: list[Run], files, statuses: dict[str, str], command: str
) -> tuple[str, list[str]]:
    """The markdown report (and PNG paths): measured figures beside the simulator's, per workload."""
    date = datetime.date.today().isoformat()
    lines = [
        f"# Benchmark suite: DistCA against the alternatives, {args.gpus} GPU(s) ({args.name})",
        "",
        f"GPU: {gpu_name()}; {versions()}; {date}.",
        "",
        f"Command: `{command}`",
        "",
        f"Model: Llama-3-8B-shaped, {args.layers} layers (hidden 4096, 32/8 heads x 128, MLP 14336, vocabulary "
        f"128256), bf16, activation checkpointing{'' if args.no_liger else ', --liger (fused linear cross-entropy)'}; "
        f"{args.steps} steps per run, medians over steps {args.skip + 1}-{args.steps}; seed {args.seed} (every "
        f"system trains the same documents); links: {'NCCL_P2P_DISABLE=1' if args.link == 'host' else 'NVLink'}.",
        "",
        "Measured: median step time (slowest rank), tokens/s (real tokens), MFU (model FLOPs incl. causal "
        "attention / (time x GPUs x 989 TFLOP/s)), peak memory (max over ranks), attention imbalance (planned "
        "FLOPs max/mean; for hf-default the full-context load of its pieces, more than it computes), GiB sent "
        "per step (busiest rank). Predicted (benchmarks/simulate.py on the same batches; "
        + ("kernel table " + portable(args.kernel_table) if args.kernel_table else "kernels_h200.md figures")
        + f", recompute {args.recompute}): step time, busy-time imbalance, exposed communication. Ideal speedup: the simulator's "
        "exact-unbalanced / ideal (perfect balance, no exposed communication); share of ideal gain: "
        "(measured speedup - 1) / (ideal speedup - 1), both against measured exact-unbalanced.",
        "",
        "Systems: "
        + "; ".join(f"{s}: `{shlex.join([SYSTEM_RUNS[s][0], *SYSTEM_RUNS[s][1]])}`" for s in args.systems),
    ]
    plots = []
    for name, (_, sample) in files.items():
        for tokens_per_rank in args.tokens_per_rank:
            group = [r for r in runs if r.workload == name and r.tokens_per_rank == tokens_per_rank]
            steps, predicted, model = predict(args, sample, tokens_per_rank, [r.system for r in group])
            lines += [
                "",
                f"## {name}, {tokens_per_rank} tokens per rank",
                "",
                "| system | status | step s | tokens/s | MFU | peak GiB | first loss | attn imbalance | GiB sent "
                "| predicted step s | error | predicted imbalance | predicted exposed comm s | speedup vs exact-unbalanced |",
                "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            measured: dict[str, Measured] = {}
            problems: dict[str, str] = {}
            for run in group:
                reason = stale(run) if read_metrics(run.out_dir) else None
                if reason is not None:
                    problems[run.out_dir] = f"left out: {reason}"
                elif read_metrics(run.out_dir):
                    try:
                        measured[run.system] = measure(run.out_dir, steps, model, args.gpus, args.skip)
                    except ValueError as err:  # too few steps recorded (a run that stopped early)
                        problems[run.out_dir] = str(err)
            base = measured.get("exact-unbalanced")
            for run in group:
                p = prediction(predicted, run.system)
                status = statuses.get(run.out_dir, "kept" if run.system in measured else "not run")
                if run.out_dir in problems:
                    status = (
                        problems[run.out_dir] if status == "not run" else f"{status}; {problems[run.out_dir]}"
                    )
                m = measured.get(run.system)
                step, imbalance, exposed = (
                    (f"{p.step_s:.2f}", f"{p.imbalance:.2f}", f"{p.exposed_comm_s:.2f}")
                    if p
                    else ("-", "-", "-")
                )
                if m is None:
                    lines.append(
                        f"| {run.system} | {status} | | | | | | | | {step} | | {imbalance} | {exposed} | |"
                    )
                    continue
                peak = "-" if m.peak_memory_gib is None else f"{m.peak_memory_gib:.1f}"
                sent = "-" if m.sent_gib_max is None else f"{m.sent_gib_max:.2f}"
                speedup = f"{base.step_s / m.step_s:.2f}x" if base else "-"
                error = f"{p.step_s / m.step_s - 1:+.0%}" if p else "-"
                lines.append(
                    f"| {run.system} | {status} | {m.step_s:.3f} | {m.tokens_per_s:,.0f} | {m.mfu:.1%} | {peak} "
                    f"| {m.first_loss:.5f} | {m.imbalance_after:.2f} | {sent} | {step} | {error} | {imbalance} "
                    f"| {exposed} | {speedup} |"
                )
            lines += ["", headline(measured, predicted)]
            png = os.path.join(args.results_dir, f"{date}-{args.name}-{name}-{tokens_per_rank}.png")
            if measured:
                plot_group(
                    measured,
                    predicted,
                    f"{name}, {tokens_per_rank // 1024}K tokens/rank, {args.gpus} GPU(s)",
                    png,
                )
                plots.append(png)
                lines += ["", f"![{name} {tokens_per_rank}]({os.path.basename(png)})"]
    return "\n".join(lines) + "\n", plots


def prediction(predicted: dict[str, sim.Result], system: str) -> sim.Result | None:
    """The simulator's result for ``system`` (None for systems it does not model)."""
    key = SIMULATED_AS.get(system, system)
    return None if key is None else predicted[key]


def headline(measured: dict[str, Measured], predicted: dict[str, sim.Result]) -> str:
    """DistCA's measured speedup over exact-unbalanced against the ideal one (the headline number)."""
    if "distca" not in measured or "exact-unbalanced" not in measured:
        return "DistCA against the ideal: needs measured distca and exact-unbalanced runs."
    base, mine = measured["exact-unbalanced"].step_s, measured["distca"].step_s
    ideal = predicted["exact-unbalanced"].step_s / predicted["exact-unbalanced"].ideal_step_s
    speedup = base / mine
    exact = {k: v.step_s for k, v in measured.items() if k not in NOT_EXACT}
    text = (
        f"DistCA against the ideal: {speedup:.2f}x over exact-unbalanced, ideal {ideal:.2f}x (predicted); "
        f"fastest exact system measured: {min(exact, key=exact.get)}"
    )
    if ideal >= 1.02:
        text += f"; share of the ideal gain reached: {(speedup - 1) / (ideal - 1):.0%} (goal >= 90%)."
    else:
        text += "; less than 2% to gain on these batches."
    return text


def plot_group(
    measured: dict[str, Measured], predicted: dict[str, sim.Result], title: str, path: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(measured)
    xs = range(len(names))
    fig, ax = plt.subplots(figsize=(1.4 * len(names) + 2.5, 3.4))
    ax.bar([x - 0.2 for x in xs], [measured[n].step_s for n in names], 0.4, label="measured")
    ax.bar([x + 0.2 for x in xs], [getattr(prediction(predicted, n), "step_s", float("nan")) for n in names], 0.4,
           label="predicted (simulator)", alpha=0.7)  # fmt: skip
    ideal = predicted["exact-unbalanced"].ideal_step_s
    base = measured.get("exact-unbalanced")
    if base:  # the ideal, anchored to the measured exact-unbalanced step
        ax.axhline(
            base.step_s * ideal / predicted["exact-unbalanced"].step_s, color="k", ls="--", label="ideal"
        )
    ax.set_xticks(list(xs), names, fontsize=8)
    ax.set_ylabel("step time (s)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
