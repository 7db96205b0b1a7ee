"""The benchmark suite: DistCA against what users run instead, on N GPUs, measured next to the simulator.

For every workload (a document-length distribution) and token budget it trains a Llama-3-8B-shaped
model (``--layers`` decoder layers, bf16, activation checkpointing, ``--liger``'s fused linear
cross-entropy) on the same documents (same seed) with every system, each through the recipe the way
its users would turn it on:

=================  =====================================================================================
hf-default         ``recipes/finetune_long_docs.py --layout hf-default --attn local``: data parallel,
                   each rank packs whole documents in dataset order up to its budget, varlen kernel
                   (the same torch varlen kernel as DistCA); documents longer than the budget become
                   independent chunks: **the math differs** (hf_distca.data.baselines)
exact-unbalanced   ``--layout tokens --max-planner-moves 0``: DistCA's data path with the token-only
                   rebatcher layout (longest documents first onto the rank with the most free space) and
                   exact cross-rank attention, balancing off (``--tolerance 9.9`` is not off: the planner
                   still moves work once a rank holds more than 10.9x the mean, as with ProLong's
                   300K-token documents on 512 GPUs)
balanced           ``--layout balanced --max-planner-moves 0``: WLB-LLM-style balanced packing, long documents
                   split head/tail over ranks (per-document context parallelism), exact through DistCA's
                   engine with balancing off; DistCA's own layout, without its planner
distca             the recipe's defaults (the balanced layout, planner tolerance 0.1;
                   rematerialization-aware checkpointing where hf_distca has it)
distca-sft         ``recipes/sft_trl.py``: DistCA through TRL's SFTTrainer (its own fused LM head
                   instead of --liger); needs trl and datasets on the GPU machine
ulysses            ``recipes/sequence_parallel_long_docs.py --parallelism ulysses``: DeepSpeed Ulysses /
                   ALST through Accelerate's ``parallelism_config`` (``sp_backend="deepspeed"``,
                   ``sp_size`` = ``--gpus``), ZeRO-3; each step's documents packed into one row that the
                   ranks shard by sequence and attend by heads; core attention: hf_distca's
                   document-aware varlen attention (``torch_varlen``; flash-attn is not on the GPU
                   image); exact (tested on CPU against one process); needs the DeepSpeed wheels
torch-cp           ``recipes/sequence_parallel_long_docs.py --parallelism torch-cp --attn sdpa``: torch
                   context parallelism through Accelerate's ``cp_size`` (FSDP2, SDPA); Accelerate
                   replaces the document mask with whole-row causal attention: **the math differs**
                   (packed documents see each other; tests/test_sequence_parallel.py)
=================  =====================================================================================

Not exact: hf-default and torch-cp (left out of "fastest exact system"). The simulator has no model of
ulysses and torch-cp: their prediction columns stay empty. ``ulysses`` and ``torch-cp`` are not in the
default ``--systems``: run them with ``--systems ulysses torch-cp`` (DeepSpeed and its dependencies carried
as wheels for ulysses); ulysses needs heads and KV heads divisible by ``--gpus`` (KV
heads fewer than GPUs are replicated), which Llama-3-8B's 32/8 meet for 2, 4 and 8 GPUs.

Every run writes ``metrics.jsonl`` and ``summary.json`` (peak memory per rank) under ``--runs-dir``, and
the suite stamps a finished run with what made it (``suite_run.json``: the recipe command, its
environment, ``DistCAConfig``'s defaults); runs that already hold ``--steps`` steps under the same stamp
are not run again, so the suite can be run in parts (e.g. one ``--workload`` per call) and a last call
with ``--report-only`` writes the report. A run whose stamp differs (another command, or a default that
changed since, e.g. ``pad_to_budget``) is run again, and the report leaves it out, saying why. The report,
``benchmarks/results/<date>-<name>.md`` with ``<date>-<name>-<workload>.png`` plots, has per system:
median step time (after ``--skip`` warm-up steps), tokens/s (real tokens), MFU (model FLOPs with causal
attention over 989 TFLOP/s per GPU), peak memory per rank, attention imbalance (planned FLOPs,
max/mean) and bytes sent per rank; the simulator's prediction for the same batches beside it
(step time, busy-time imbalance, exposed communication, prediction error); and DistCA's speedup over
exact-unbalanced against the ideal speedup (the simulator's ideal/exact-unbalanced ratio: perfect
balance of the exact work with no exposed communication, from the kernel table and the linear fit)
as the share of the ideal gain it reaches. Per-rank busy time and exposed communication are not
measured by the recipe: those columns are the simulator's.

On the GPU machine (2 x H200 now; any N: ``--gpus N``), from the repository root, with liger-kernel
(and, for distca-sft, trl and datasets) importable, e.g. one workload per call to stay under 10 minutes
(``--calibrate`` measures the kernel table of the backend the runs use once, ~1-2 minutes, and the
prediction and the ideal are priced with it):

    python -m benchmarks.suite --name 2xh200 --gpus 2 --calibrate --workload pretrain=DATA/doclens_pretrain.json \\
        --tokens-per-rank 65536 --layers 16 --steps 6
    python -m benchmarks.suite --name 2xh200 --gpus 2 --calibrate --workload prolong=DATA/doclens_prolong.json \\
        --tokens-per-rank 65536 --layers 16 --steps 6
    python -m benchmarks.suite --name 2xh200 --gpus 2 --calibrate --workload long-mix --tokens-per-rank 65536 \\
        --layers 16 --steps 6
    python -m benchmarks.suite --name 2xh200 --gpus 2 --calibrate --workload pretrain=DATA/doclens_pretrain.json \\
        --workload prolong=DATA/doclens_prolong.json --workload long-mix --tokens-per-rank 65536 \\
        --layers 16 --steps 6 --report-only

The sequence-parallel baselines, once per workload (DeepSpeed 0.19.8 and its dependencies importable, e.g.
``PYTHONPATH=WHEELS``; not in the default systems):

    python -m benchmarks.suite --name 2xh200 --gpus 2 --workload long-mix --tokens-per-rank 65536 --layers 16 \\
        --steps 6 --systems ulysses torch-cp

(DATA: the directory of the shared length samples. Add ``--tokens-per-rank 32768 65536`` for both
budgets; ``--link host`` repeats the runs with ``NCCL_P2P_DISABLE=1`` and prices the simulator's link
accordingly; ``--layers 32 --accelerate-config accelerate_configs/fsdp2_1node.yaml`` if 16 layers fit
easily; ``--systems`` splits a workload's runs over several calls.) ``--dry-run`` prints the commands
without running them.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from hf_distca.config import DistCAConfig

from . import sim
from .simulate import portable
from .workloads import LONG_MIX, documents_for, draw_lengths, global_batches, load_sample

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEM_RUNS = {
    # system -> (recipe, its flags)
    "hf-default": ("recipes/finetune_long_docs.py", ["--layout", "hf-default", "--attn", "local"]),
    "exact-unbalanced": ("recipes/finetune_long_docs.py", ["--layout", "tokens", "--max-planner-moves", "0"]),
    "balanced": ("recipes/finetune_long_docs.py", ["--layout", "balanced", "--max-planner-moves", "0"]),
    "distca": ("recipes/finetune_long_docs.py", []),
    "distca-sft": ("recipes/sft_trl.py", []),
    "ulysses": ("recipes/sequence_parallel_long_docs.py", ["--parallelism", "ulysses"]),
    "torch-cp": ("recipes/sequence_parallel_long_docs.py", ["--parallelism", "torch-cp", "--attn", "sdpa"]),
}
SIMULATED_AS = {"distca-sft": "distca", "ulysses": None, "torch-cp": None}
"""Systems the simulator prices as another (the same batches and plans); None: not modelled."""
SELF_CONFIGURED = ("ulysses", "torch-cp")
"""Systems launched with torchrun even under --accelerate-config (their recipe configures the parallelism)."""
NOT_EXACT = ("hf-default", "torch-cp")
"""Systems whose attention differs from the per-document math (left out of the fastest exact system)."""
DEFAULT_SYSTEMS = ("hf-default", "exact-unbalanced", "balanced", "distca")
LEARNING_RATE = "1e-5"


@dataclass(frozen=True)
class Run:
    """One recipe run of the suite."""

    workload: str
    tokens_per_rank: int
    system: str
    out_dir: str
    command: list[str]
    env: dict[str, str]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", required=True, help="report name: benchmarks/results/<date>-<name>.md")
    p.add_argument(
        "--workload",
        action="append",
        required=True,
        help="'long-mix', a JSON file of document lengths, or name=FILE; repeat for several",
    )
    p.add_argument("--gpus", type=int, required=True, help="GPUs (processes) per run, on one node")
    p.add_argument("--tokens-per-rank", type=int, nargs="+", default=[65536])
    p.add_argument("--layers", type=int, default=16, help="decoder layers of the Llama-3-8B-shaped model")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run")
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the medians")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", nargs="+", choices=sorted(SYSTEM_RUNS), default=list(DEFAULT_SYSTEMS))
    p.add_argument("--no-liger", action="store_true", help="leave out --liger (when liger-kernel is missing)")
    p.add_argument(
        "--link",
        choices=("nvlink", "host"),
        default="nvlink",
        help="host: NCCL_P2P_DISABLE=1 for every run (the stand-in for inter-node links)",
    )
    p.add_argument(
        "--accelerate-config", default=None, help="launch with accelerate and this config instead of torchrun"
    )
    p.add_argument(
        "--kernel-table", default=None, help="JSON from python -m hf_distca.calibrate (prediction)"
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="measure the kernel table on this GPU first (python -m hf_distca.calibrate, with the backend "
        "the runs use) into the runs dir, once, and price the prediction with it",
    )
    p.add_argument(
        "--recompute",
        choices=("remat", "full"),
        default="remat",
        help="how the prediction prices checkpointing: remat (hf_distca's rematerialization-aware "
        "checkpointing) or full (plain recompute, where hf_distca has no remat yet)",
    )
    p.add_argument("--runs-dir", default=None, help="default: outputs/suite/<name>")
    p.add_argument("--results-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    p.add_argument("--dry-run", action="store_true", help="print the recipe commands, run nothing")
    p.add_argument("--report-only", action="store_true", help="run nothing, write the report from --runs-dir")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.gpus < 1:
        p.error(f"--gpus must be >= 1, got {args.gpus}")
    if min(args.tokens_per_rank) < 128:
        p.error("--tokens-per-rank must be >= 128 (one shard)")
    if not 0 <= args.skip < args.steps:
        p.error(f"--skip ({args.skip}) must leave at least one of the --steps ({args.steps}) measured")
    if args.dry_run and args.report_only:
        p.error("--dry-run and --report-only exclude each other")
    if args.calibrate and args.kernel_table:
        p.error("--calibrate writes the kernel table itself: leave out --kernel-table")
    args.runs_dir = args.runs_dir or os.path.join(ROOT, "outputs", "suite", args.name)
    if args.calibrate:
        args.kernel_table = os.path.join(args.runs_dir, "cost_table.json")
    return args


def calibration_command(args) -> list[str] | None:
    """The command that measures the kernel table (--calibrate), None when it exists or is not asked for."""
    if not args.calibrate or os.path.exists(args.kernel_table):
        return None
    return [sys.executable, "-m", "hf_distca.calibrate", "--out", args.kernel_table]


def workload_files(args) -> dict[str, tuple[str, list[int]]]:
    """name -> (file the recipe reads with --doc-lengths, its sample); long-mix is written to the runs dir."""
    out = {}
    for spec in args.workload:
        name, sample = load_sample(spec, seed=args.seed)
        if name in out:
            raise SystemExit(f"workload {name!r} given twice")
        if spec == LONG_MIX:
            path = os.path.join(args.runs_dir, "long-mix.json")
            if not args.dry_run:
                os.makedirs(args.runs_dir, exist_ok=True)
                with open(path, "w") as f:
                    json.dump(sample, f)
        else:
            path = spec.partition("=")[2] or spec
        out[name] = (os.path.abspath(path), sample)
    return out


def plan_runs(args, files: dict[str, tuple[str, list[int]]]) -> list[Run]:
    """Every (workload, token budget, system) run with its recipe command."""
    runs = []
    env = {"NCCL_P2P_DISABLE": "1"} if args.link == "host" else {}
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(args.gpus),
    ]
    launcher = (
        ["accelerate", "launch", "--config_file", args.accelerate_config, "--num_processes", str(args.gpus)]
        if args.accelerate_config
        else torchrun
    )
    for name, (path, sample) in files.items():
        for tokens_per_rank in args.tokens_per_rank:
            count = documents_for(sample, args.steps, args.gpus * tokens_per_rank)
            for system in args.systems:
                recipe, flags = SYSTEM_RUNS[system]
                # the sequence-parallel recipe sets up DeepSpeed / FSDP2 itself: an accelerate config would clash
                launch = torchrun if system in SELF_CONFIGURED else launcher
                link = "-p2p-off" if args.link == "host" else ""
                out_dir = os.path.join(args.runs_dir, f"{name}-{tokens_per_rank}-{system}{link}")
                liger = [] if args.no_liger or recipe.endswith("sft_trl.py") else ["--liger"]
                command = [
                    *launch, recipe, "--model", "llama3-8b-shaped", "--num-layers", str(args.layers),
                    "--tokens-per-rank", str(tokens_per_rank), "--bf16", "--gradient-checkpointing", *liger,
                    "--doc-lengths", path, "--num-documents", str(count), "--seed", str(args.seed),
                    "--max-steps", str(args.steps), "--learning-rate", LEARNING_RATE, "--no-save",
                    "--output-dir", out_dir, *flags,
                ]  # fmt: skip
                runs.append(Run(name, tokens_per_rank, system, out_dir, command, env))
    return runs


def read_metrics(out_dir: str) -> list[dict]:
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


STAMP_FILE = "suite_run.json"
"""A finished run's stamp (:func:`run_stamp`), in its output directory."""


def run_stamp(run: Run) -> dict:
    """What a run is made with: its command from the script on (launcher and interpreter may differ between
    the parts of one suite), its environment, and ``DistCAConfig``'s defaults (a changed default changes
    what the same command trains)."""
    script = next((i for i, word in enumerate(run.command) if word.endswith(".py")), 1)
    return {
        "command": list(run.command[script:]),
        "env": dict(run.env),
        "distca_defaults": dataclasses.asdict(DistCAConfig()),
    }


def write_stamp(run: Run) -> None:
    with open(os.path.join(run.out_dir, STAMP_FILE), "w") as f:
        json.dump(run_stamp(run), f, indent=1)


def stale(run: Run) -> str | None:
    """Why the results in ``run.out_dir`` are not this run's (None when its stamp matches)."""
    path = os.path.join(run.out_dir, STAMP_FILE)
    if not os.path.exists(path):
        return f"no {STAMP_FILE}: made by an older suite"
    with open(path) as f:
        got = json.load(f)
    want = run_stamp(run)
    if got.get("command") != want["command"] or got.get("env") != want["env"]:
        return "made by another command"
    old = got.get("distca_defaults", {})
    changed = [k for k, v in want["distca_defaults"].items() if old.get(k) != v]
    return f"made under other DistCAConfig defaults ({', '.join(changed)})" if changed else None


def execute(run: Run, steps: int, timeout: int, log=print) -> str:
    """Run one recipe command unless its metrics already hold ``steps`` steps under its stamp; 'ok', 'kept'
    or a failure."""
    if len(read_metrics(run.out_dir)) >= steps and stale(run) is None:
        return "kept"
    os.makedirs(run.out_dir, exist_ok=True)
    log(f"== {run.workload} {run.tokens_per_rank} {run.system}: {shlex.join(run.command)}")
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)  # keeps carried wheels
    env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_DISABLE_TELEMETRY="1", NCCL_NVLS_ENABLE="0", **run.env)  # fmt: skip
    with open(os.path.join(run.out_dir, "run.log"), "w") as f:
        try:
            proc = subprocess.run(
                run.command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout} s"
    if proc.returncode != 0:
        return f"failed (exit {proc.returncode}): {failure_reason(os.path.join(run.out_dir, 'run.log'))}"
    write_stamp(run)
    return "ok"


def failure_reason(log_path: str) -> str:
    """The last exception line of a run's log (e.g. torch.OutOfMemoryError: ...), shortened."""
    try:
        with open(log_path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return "no log"
    errors = [line for line in lines if "Error" in line.split(":", 1)[0]]
    return (errors[-1] if errors else lines[-1] if lines else "empty log")[:160]


# ------------------------------------------------------------------------------------------ figures


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


def main(argv: Sequence[str] | None = None) -> str | None:
    argv = list(argv if argv is not None else sys.argv[1:])
    args = parse_args(argv)
    files = workload_files(args)
    runs = plan_runs(args, files)
    calibrate = calibration_command(args)
    if args.dry_run:
        if calibrate:
            print(shlex.join(calibrate))
        for run in runs:
            prefix = "".join(f"{k}={v} " for k, v in run.env.items())
            print(f"{prefix}{shlex.join(run.command)}")
        return None
    statuses = {}
    if calibrate and not args.report_only:
        os.makedirs(args.runs_dir, exist_ok=True)
        subprocess.run(calibrate, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), check=True)
    if args.kernel_table and not os.path.exists(args.kernel_table):
        raise SystemExit(f"no kernel table at {args.kernel_table}: run without --report-only first")
    if not args.report_only:
        for run in runs:
            statuses[run.out_dir] = execute(run, args.steps, args.timeout)
            print(f"{run.workload} {run.tokens_per_rank} {run.system}: {statuses[run.out_dir]}", flush=True)
    command = "python -m benchmarks.suite " + " ".join(shlex.quote(portable(a)) for a in argv)
    report, plots = write_report(args, runs, files, statuses, command)
    os.makedirs(args.results_dir, exist_ok=True)
    path = os.path.join(args.results_dir, f"{datetime.date.today().isoformat()}-{args.name}.md")
    with open(path, "w") as f:
        f.write(report)
    print(f"wrote {path}" + "".join(f", {p}" for p in plots))
    return path


if __name__ == "__main__":
    main()
