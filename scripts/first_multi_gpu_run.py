"""The first multi-GPU run as one command: the engine's equality check over NCCL, then the main recipe under
DDP, FSDP2 and DeepSpeed ZeRO-3, each serial, with ping-pong, with layer-level ping-pong and with the KV
relay, then one step of DDP with ping-pong under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``; one results file.

    bash scripts/first_multi_gpu_run.sh 8          # 8 GPUs of one node
    bash scripts/first_multi_gpu_run.sh 2 --cpu    # the same runs on 2 CPU processes over gloo

Every run gets a short timeout on its process group (the engine's group: ``--group-timeout`` seconds, the
recipe's ``--ddp-timeout``, the check's ``--timeout``), NCCL's flight recorder (``TORCH_FR_BUFFER_SIZE``,
``TORCH_NCCL_DUMP_ON_TIMEOUT=1``: a hung collective leaves each rank's last collectives in the run's log
folder) and NVLink multicast off (``NCCL_NVLS_ENABLE=0`` and its PyTorch and NVSHMEM counterparts). The
relay runs treat the N ranks as two nodes of N/2 (``--ranks-per-node``; 4 ranks or more, even). Without a GPU (or with ``--cpu``)
every run uses gloo on CPU processes; FSDP2 is then skipped (Accelerate enables FSDP only on accelerators)
and ZeRO-3 runs through ``--deepspeed`` with the recipe's optimizer. ``<out>/results.md``: one row per run (exit status, seconds,
final loss, its log folder); the exit status is 0 only when every run that was not skipped passed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = "recipes/finetune_long_docs.py"
ENGINE_CHECK = "tests/gpu_nccl_engine_check.py"
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast off in NCCL, PyTorch's symmetric memory and NVSHMEM."""
CPU_ZERO3 = "ds_zero3_cpu.json"
"""ZeRO-3 on the CPU: accelerate_configs/ds_zero3.json without its optimizer (DeepSpeed then steps the
recipe's torch optimizer, as tests/test_parallelisms.py runs it), written into the output folder."""
PARALLELISMS = {  # name: (accelerate config on GPUs, on the CPU; extra recipe arguments on the CPU)
    "ddp": ("accelerate_configs/ddp_1node.yaml", "accelerate_configs/cpu_2proc.yaml", []),
    "fsdp2": ("accelerate_configs/fsdp2_1node.yaml", None, []),
    "zero3": (
        "accelerate_configs/deepspeed_zero3.yaml",
        "accelerate_configs/cpu_2proc.yaml",
        ["--deepspeed", CPU_ZERO3],
    ),
}
CPU_SKIPS = {"fsdp2": "FSDP needs GPUs (Accelerate enables it only on accelerators)"}


def schedules(ranks_per_node: int | None) -> dict[str, list[str] | None]:
    """The recipe's engine flags per schedule (None: not possible with these ranks)."""
    relay = (
        None
        if ranks_per_node is None
        else ["--ping-pong", "--kv-relay", "--ranks-per-node", str(ranks_per_node)]
    )
    return {
        "serial": ["--no-ping-pong"],
        "ping_pong": ["--ping-pong"],
        "layer_ping_pong": ["--layer-ping-pong"],
        "relay": relay,
    }


@dataclasses.dataclass
class Run:
    """One command of the run: its name, argv, environment additions, log folder and timeout."""

    name: str
    argv: list[str]
    env: dict[str, str]
    logs: str
    timeout: float
    skip: str | None = None
    """Why it does not run here (None: it runs)."""
    output_dir: str | None = None
    """The recipe's --output-dir (its summary.json holds the final loss); None for the engine check."""


@dataclasses.dataclass
class Result:
    run: Run
    exit: str
    seconds: float | None = None
    loss: float | None = None

    @property
    def passed(self) -> bool:
        return self.run.skip is not None or self.exit == "0"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("processes", type=int, help="ranks: GPUs of this node (or CPU processes with --cpu)")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU processes (the default without a GPU)")
    p.add_argument("--out", default="outputs/first_multi_gpu_run", help="results.md and every run's logs")
    p.add_argument(
        "--max-steps", type=int, default=None, help="optimizer steps per recipe run (GPU 5, CPU 2)"
    )
    p.add_argument(
        "--group-timeout", type=int, default=180, help="seconds a collective may wait (default 180)"
    )
    p.add_argument("--run-timeout", type=int, default=None, help="seconds per run (GPU 1200, CPU 600)")
    p.add_argument("--model", default="tiny-llama", help="the recipe's --model (default tiny-llama)")
    p.add_argument(
        "--fr-buffer", type=int, default=20000, help="TORCH_FR_BUFFER_SIZE: collectives kept per rank"
    )
    p.add_argument("--only", default=None, help="run only the runs whose name contains this text")
    p.add_argument("--dry-run", action="store_true", help="print the commands; run nothing")
    args = p.parse_args(argv)
    if args.processes < 1:
        p.error(f"processes must be at least 1, got {args.processes}")
    if args.max_steps is not None and args.max_steps < 1:
        p.error(f"--max-steps must be at least 1, got {args.max_steps}")
    if args.group_timeout < 10:
        p.error(f"--group-timeout below 10 s would fail healthy runs at start-up, got {args.group_timeout}")
    return args


def gpus_available() -> int:
    """CUDA devices visible to this process (0 without CUDA or torch)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def plan_runs(args: argparse.Namespace, gpus: int) -> list[Run]:
    """Every run of the command, in order (skipped ones included, with the reason)."""
    cpu = args.cpu or gpus == 0
    n = args.processes
    if not cpu and n > gpus:
        raise SystemExit(f"{n} processes asked for but {gpus} GPU(s) visible; pass at most {gpus} or --cpu")
    steps = args.max_steps or (2 if cpu else 5)
    timeout = args.run_timeout or (600 if cpu else 1200)
    ranks_per_node = n // 2 if n >= 4 and n % 2 == 0 else None  # two "nodes" of 2 ranks or more: the relay
    out = os.path.abspath(args.out)
    base_env = {
        **NO_MULTICAST,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_BUFFER_SIZE": str(args.fr_buffer),
        "OMP_NUM_THREADS": "1" if cpu else os.environ.get("OMP_NUM_THREADS", "4"),
        "TOKENIZERS_PARALLELISM": "false",
        # DeepSpeed's JIT-built ops (on the CPU its shared-memory comm op) in this run's folder: a run killed
        # while building leaves a lock that would stall every later build in a shared cache
        "TORCH_EXTENSIONS_DIR": os.path.join(out, "torch_extensions"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    python = sys.executable
    runs = []

    def folder(name: str) -> str:
        """The run's folder: its logs and, for a recipe run, its --output-dir."""
        return os.path.join(out, name.replace(":", "_"))

    def add(name: str, argv: list[str], extra_env: dict | None = None, skip: str | None = None, **kw) -> None:
        logs = folder(name)
        env = {**base_env, "TORCH_FR_DUMP_TEMP_FILE": os.path.join(logs, "flight_recorder_rank_"),
               "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join(logs, "flight_recorder_rank_"), **(extra_env or {})}  # fmt: skip
        runs.append(Run(name, argv, env, logs, timeout, skip, **kw))

    check = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port", "{port}", ENGINE_CHECK,
             "--timeout", str(args.group_timeout)]  # fmt: skip
    if cpu:
        check += ["--backend", "gloo", "--cpu", "--repeat", "1"]
    if ranks_per_node is not None:
        check += ["--ranks-per-node", str(ranks_per_node)]
    add("engine_check", check, skip=None if n >= 2 else "needs 2 ranks or more")
    recipe_common = ["--model", args.model, "--no-save", "--gradient-checkpointing", "--ddp-timeout",
                     str(args.group_timeout), "--shard-tokens", "64"]  # fmt: skip
    if cpu:
        recipe_common += ["--cpu", "--tokens-per-rank", "512", "--num-documents", "48", "--mean-doc-words", "120",
                          "--max-doc-words", "600"]  # fmt: skip
    for parallelism, (gpu_config, cpu_config, cpu_extra) in PARALLELISMS.items():
        for schedule, flags in schedules(ranks_per_node).items():
            name = f"{parallelism}:{schedule}"
            skip = CPU_SKIPS.get(parallelism) if cpu else None
            if flags is None:
                skip = "the relay needs two nodes of 2 ranks or more (an even number of ranks, 4 or more)"
            output_dir = folder(name)
            recipe_args = [
                *recipe_common,
                "--max-steps",
                str(steps),
                *([os.path.join(out, a) if a == CPU_ZERO3 else a for a in cpu_extra] if cpu else []),
                *(flags or []),
            ]
            config = (cpu_config if cpu else None) or gpu_config
            add(name, _launch(python, config, n, output_dir, recipe_args), skip=skip, output_dir=output_dir)
    ddp = PARALLELISMS["ddp"][1 if cpu else 0]
    detail_dir = folder("ddp:ping_pong:debug_detail")
    detail_args = [
        *recipe_common,
        "--max-steps",
        "1",
        "--ping-pong",
    ]  # one step: DETAIL checks every collective
    add("ddp:ping_pong:debug_detail", _launch(python, ddp, n, detail_dir, detail_args),
        {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, output_dir=detail_dir)  # fmt: skip
    if args.only:
        runs = [r for r in runs if args.only in r.name]
    return runs


def _launch(python: str, config: str, n: int, output_dir: str, recipe_args: list[str]) -> list[str]:
    return [python, "-m", "accelerate.commands.launch", "--config_file", config, "--num_processes", str(n),
            "--main_process_port", "{port}", RECIPE, "--output-dir", output_dir, *recipe_args]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def final_loss(output_dir: str | None) -> float | None:
    """The recipe's final loss from its summary.json (None when it wrote none)."""
    if output_dir is None:
        return None
    try:
        with open(os.path.join(output_dir, "summary.json")) as f:
            loss = json.load(f).get("final_loss")
    except (OSError, ValueError):
        return None
    return None if loss is None else float(loss)


def execute(run: Run) -> Result:
    """Run ``run`` in its own process group (killed whole at its timeout), its output in its log folder."""
    if run.skip is not None:
        return Result(run, f"skipped: {run.skip}")
    os.makedirs(run.logs, exist_ok=True)
    argv = [a.replace("{port}", str(_free_port())) for a in run.argv]
    with open(os.path.join(run.logs, "command.txt"), "w") as f:
        f.write(
            " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(run.env.items()))
            + " \\\n  "
            + shlex.join(argv)
            + "\n"
        )
    start = time.monotonic()
    with open(os.path.join(run.logs, "output.log"), "w") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **run.env}, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            code = str(proc.wait(timeout=run.timeout))
        except subprocess.TimeoutExpired:
            code = f"timeout ({run.timeout:.0f} s)"
        finally:
            _kill_tree(
                proc.pid
            )  # whatever the launcher left running (its ranks run in sessions of their own)
            proc.wait()
    return Result(run, code, time.monotonic() - start, final_loss(run.output_dir))


def write_cpu_zero3_config(out: str) -> str:
    """``<out>/ds_zero3_cpu.json`` (see CPU_ZERO3); returns its path."""
    with open(os.path.join(ROOT, "accelerate_configs", "ds_zero3.json")) as f:
        config = json.load(f)
    del config["optimizer"]
    config["zero_allow_untested_optimizer"] = True  # a torch optimizer on ZeRO's flat fp32 partitions
    path = os.path.join(out, CPU_ZERO3)
    with open(path, "w") as f:
        json.dump(config, f, indent=1)
    return path


def _kill_tree(pid: int) -> None:
    """Kill ``pid``'s process group and every process descending from it."""
    import psutil  # Accelerate's dependency

    try:
        tree = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    for child in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


def results_table(results: list[Result], out: str) -> str:
    """The markdown table of ``results`` (log folders relative to ``out``)."""
    lines = ["| run | exit | seconds | loss | logs |", "|---|---|---|---|---|"]
    for r in results:
        seconds = "" if r.seconds is None else f"{r.seconds:.1f}"
        loss = "" if r.loss is None else f"{r.loss:.4f}"
        logs = "" if r.run.skip is not None else os.path.relpath(r.run.logs, out) + "/"
        lines.append(f"| {r.run.name} | {r.exit} | {seconds} | {loss} | {logs} |")
    return "\n".join(lines)


def write_results(path: str, results: list[Result], header: dict[str, str]) -> None:
    passed = all(r.passed for r in results)
    text = ["# First multi-GPU run", ""]
    text += [f"- {k}: {v}" for k, v in header.items()]
    text += [f"- status: {'PASS' if passed else 'FAIL'} ({sum(r.passed for r in results)}/{len(results)} runs passed "
             "or skipped)", "", results_table(results, os.path.dirname(path)), "",
             "Each log folder holds the run's command (command.txt), its output (output.log) and, after a "
             "collective timed out, each rank's flight-recorder dump (flight_recorder_rank_*).", ""]  # fmt: skip
    with open(path, "w") as f:
        f.write("\n".join(text))


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpus = gpus_available()
    runs = plan_runs(args, gpus)
    cpu = args.cpu or gpus == 0
    if args.dry_run:
        for run in runs:
            state = f"  # skipped: {run.skip}" if run.skip else ""
            print(f"{run.name}:{state}\n  {shlex.join(run.argv)}")
        return 0
    os.makedirs(args.out, exist_ok=True)
    if cpu:
        write_cpu_zero3_config(os.path.abspath(args.out))
    path = os.path.join(args.out, "results.md")
    header = {
        "command": "bash scripts/first_multi_gpu_run.sh "
        + shlex.join(argv if argv is not None else sys.argv[1:]),
        "started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _git_commit(),
        "ranks": f"{args.processes} {'CPU processes (gloo)' if cpu else 'GPUs (NCCL)'}",
        "group timeout": f"{args.group_timeout} s",
    }
    results = []
    for run in runs:
        print(f"[first_multi_gpu_run] {run.name} ...", flush=True)
        results.append(execute(run))
        r = results[-1]
        print(f"[first_multi_gpu_run] {run.name}: {r.exit}" + ("" if r.seconds is None else f" in {r.seconds:.0f} s"),
              flush=True)  # fmt: skip
        write_results(path, results, header)  # after every run: a hang later still leaves the rows before it
    print(f"[first_multi_gpu_run] results in {path}")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
