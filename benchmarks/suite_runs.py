"""The runs of benchmarks/suite.py: each system's recipe command per workload and token budget, run
unless a finished run with the same stamp (command, environment, DistCAConfig defaults) is there."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass

from hf_distca.config import DistCAConfig

from .workloads import LONG_MIX, documents_for, load_sample

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
