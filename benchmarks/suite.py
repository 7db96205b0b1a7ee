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
import datetime
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence

from .simulate import portable
from .suite_report import write_report
from .suite_runs import (
    DEFAULT_SYSTEMS,
    ROOT,
    SYSTEM_RUNS,
    calibration_command,
    execute,
    plan_runs,
    workload_files,
)


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
