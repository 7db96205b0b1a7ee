"""Run scripts' ``main(argv)`` on N CPU processes from a test, with torchrun's environment, without torchrun.

Each rank is forked from the preloaded server of tests/distributed.py (torch, Transformers, hf_distca and
the recipes imported once per test process), gets the variables torchrun gives a rank (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), and calls each script's ``main(argv)`` in turn, so
that Accelerate and the Trainer set up their gloo group as under torchrun. A launch then starts in about a
second instead of an agent plus every rank importing the stack again (10-20 s each on 2 cores).
test_training.py's demo test runs the README's own ``accelerate launch`` for real.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
from pathlib import Path

from distributed import ROOT, preloaded_context, run_processes, skip_deepspeed_shm_build

# scripts that start DeepSpeed without a --deepspeed flag (the Ulysses recipe sets its own config)
DEEPSPEED_SCRIPTS = ("sequence_parallel_long_docs.py", "ulysses_zero_stage.py")


def exact_run_args(max_steps: int, num_documents: int) -> list[str]:
    """The recipe's arguments shared by the runs that must equal a one-process run: plain SGD (weights then
    compare parameter by parameter), two accumulated micro-batches per step, generated documents of up to
    1,500 words (longer than a rank's budget, so some are cut over the ranks), 64-token shards."""
    return [
        "--max-steps", str(max_steps), "--grad-accum", "2", "--optim", "sgd", "--learning-rate", "0.5",
        "--num-documents", str(num_documents), "--mean-doc-words", "300", "--max-doc-words", "1500",
        "--shard-tokens", "64", "--seed", "3",
    ]  # fmt: skip


def baseline_args(argv: list[str], attn: str) -> list[str]:
    """``argv`` for a run without disaggregation (``--attn`` ``attn``: local, sdpa, flash): without the
    DistCAConfig flags such a run refuses as having no effect there (the engine's; for another attention than
    distca's, the kernel backend too)."""
    import dataclasses

    from hf_distca.config import ATTENTION_FUNCTION_FIELDS, DATA_PATH_FIELDS, DistCAConfig

    live = DATA_PATH_FIELDS + (ATTENTION_FUNCTION_FIELDS if attn == "local" else ())
    fields = {f.name: f for f in dataclasses.fields(DistCAConfig) if f.name not in live}
    out, i = [], 0
    while i < len(argv):
        name = argv[i].removeprefix("--no-").removeprefix("--").replace("-", "_")
        if argv[i].startswith("--") and name in fields:
            i += 1 if isinstance(fields[name].default, bool) else 2
            continue
        out.append(argv[i])
        i += 1
    return [*out, "--attn", attn]


def _script_module(script: str):
    """The module of ``script``: a file name in recipes/, a path from the repository root, or a module of
    the benchmarks package (``benchmarks.<name>``, imported from the repository root on ``sys.path``)."""
    if script.startswith("benchmarks."):
        return importlib.import_module(script)
    path = os.path.join(
        ROOT, script if os.sep in script or "/" in script else os.path.join("recipes", script)
    )
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(os.path.splitext(os.path.basename(path))[0])


def _rank_main(rank: int, world: int, port: int, runs: list, log_path: str, env: dict[str, str]) -> None:
    """One rank: torchrun's variables, output to ``log_path``, then every run's ``main(argv)`` in turn."""
    os.setsid()  # a process group of its own: run_processes stops what it starts too
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )  # fmt: skip
    import torch

    torch.set_num_threads(1)
    if any("--deepspeed" in argv or script.endswith(DEEPSPEED_SCRIPTS) for script, argv in runs):
        skip_deepspeed_shm_build()
    for script, argv in runs:
        code = _script_module(script).main(argv)
        if type(code) is int and code != 0:  # a main that reports failure by its exit status
            sys.exit(code)
    _script_module("finetune_long_docs.py").end_process_group()


def _free_port() -> int:
    """A port free now (another process may take it before rank 0 binds it: launch then retries once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    world: int, runs: list, tmp_path, env: dict[str, str] | None = None, timeout: float = 600
) -> list[str]:
    """Run ``runs`` ([script, argv] pairs; script: a file name in recipes/, a path from the repository
    root or ``benchmarks.<name>``, with a ``main(argv)``) in turn on ``world`` processes; return each rank's output. ``env``: more
    environment variables for the ranks; only those read at run time take effect (the ranks fork from a
    server that imported torch, Transformers and the recipes already). Fails the calling test with every
    rank's output when a rank fails or the launch outlives ``timeout`` seconds (the other ranks are
    stopped a few seconds after one fails, instead of waiting in a collective); whatever ends the launch,
    its processes and theirs are stopped."""
    ctx = preloaded_context()
    for attempt in range(2):  # again on a new port if another process took the free one meanwhile
        tag = f"launch{len(list(tmp_path.glob('launch*-rank0.log')))}"
        logs = [str(tmp_path / f"{tag}-rank{r}.log") for r in range(world)]
        port = _free_port()
        procs = [
            ctx.Process(target=_rank_main, args=(r, world, port, runs, logs[r], dict(env or {})))
            for r in range(world)
        ]
        run_processes(procs, timeout)
        # a rank that died before opening its log has none
        outputs = [Path(path).read_text(errors="replace") if os.path.exists(path) else "" for path in logs]
        failed = any(p.exitcode != 0 for p in procs)
        if not (failed and attempt == 0 and any("address already in use" in out.lower() for out in outputs)):
            break
    if failed:
        report = "\n".join(
            f"--- rank {r} (exit code {p.exitcode}):\n{outputs[r][-6000:]}" for r, p in enumerate(procs)
        )
        raise AssertionError(f"{world} process(es) running {[run[0] for run in runs]} failed:\n{report}")
    return outputs
