"""Run a function on N gloo processes from a test (file:// rendezvous in a fresh temp dir)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, init_file: str, out_dir: str, fn, args) -> None:
    os.setsid()  # a process group of its own: run_processes stops what it starts too
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save({"ok": True, "result": result}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, os.path.join(out_dir, f"{rank}.pt"))
        raise
    finally:
        dist.destroy_process_group()


def check_cases(cases: list[dict], results: list, checks: dict[str, Callable[[dict, list], object]]) -> dict:
    """Check every case against every rank's result of it: ``checks[case["kind"]](case, per_rank)`` with
    ``per_rank[r] = results[r][i]`` for case i, on one thread like the ranks (an exact replay then runs the
    kernel with the same bits, and small kernels are faster on one thread anyway). Returns what the checks
    returned, a list per kind."""
    returned: dict[str, list] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i, case in enumerate(cases):
            per_rank = [rank_results[i] for rank_results in results]
            returned.setdefault(case["kind"], []).append(checks[case["kind"]](case, per_rank))
    finally:
        torch.set_num_threads(threads)
    return returned


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mark_or_wait(marker_dir: str, tag: str, rank: int, world: int, odd: int, timeout: float) -> None:
    """After a case that must raise on every rank: a rank other than ``odd`` leaves a marker file; rank
    ``odd`` stays alive, outside any collective, until every other rank has left its marker (or ``timeout``
    seconds), so that the others' errors cannot come from ``odd`` having exited."""
    if rank != odd:
        open(os.path.join(marker_dir, f"{tag}.{rank}"), "w").close()
        return
    deadline = time.perf_counter() + timeout
    others = [os.path.join(marker_dir, f"{tag}.{r}") for r in range(world) if r != odd]
    while not all(os.path.exists(p) for p in others) and time.perf_counter() < deadline:
        time.sleep(0.01)


def skip_deepspeed_shm_build() -> None:
    """Mark DeepSpeed's shared-memory CPU all-reduce op as not buildable in this process.

    DeepSpeed's CPU comm backend JIT-compiles that op (used only by its ``inference_all_reduce``) in every
    process that starts it: minutes on 2 cores, under a file lock in the torch-extensions cache that a
    process killed mid-build leaves behind for every later one. The tests' collectives run on gloo, so the
    op is marked incompatible; DeepSpeed keeps edits to its ``__compatible_ops__`` dict for the process."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def preloaded_context():
    """Processes forked from a server that imported torch, Transformers, hf_distca and the main recipe once (per
    test process): each rank starts in well under a second instead of importing them again, and the server
    forks before any thread or process group of the tests exists (unlike forking the test process). The
    server starts at the first process and keeps ``sys.path`` and the environment as they were then, so the
    recipes' folder is put on it first; ``TORCH_CUDA_SANITIZER`` set before that reaches every rank (the
    server imports torch with it, and each rank is forked with the sanitizer's dispatch mode on; see
    tests/test_nccl_semantics.py)."""
    recipes = os.path.join(ROOT, "recipes")
    if recipes not in sys.path:
        sys.path.append(recipes)
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # read when the server imports huggingface_hub
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "torch.distributed", "transformers", "hf_distca", "distributed", "finetune_long_docs"]
    )
    return ctx


def run_processes(procs: list, timeout: float, grace: float = 10.0) -> list[bool]:
    """Start ``procs`` (each calls ``os.setsid()`` first), wait until every one has ended, until ``grace``
    seconds after one failed (the others may wait for it in a collective) or ``timeout`` seconds in all,
    then kill each one's process group (also what it started, e.g. a planning worker), whatever ends the
    wait. Returns, per process, whether it was still running when stopped."""
    running = [False] * len(procs)
    try:
        for p in procs:
            p.start()
        deadline, failed_at = time.monotonic() + timeout, None
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() > failed_at + grace:
                break
            time.sleep(0.2)
    finally:
        for i, p in enumerate(procs):
            if p.pid is not None:
                running[i] = p.is_alive()
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.join()
    return running


def run_distributed(fn, world: int, *args, timeout: float = 300.0) -> list:
    """Call ``fn(rank, world, *args)`` on ``world`` processes; return the per-rank results.

    ``fn`` must be importable (module level). A failure on any rank raises with its traceback.
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        ctx = preloaded_context()
        procs = [
            ctx.Process(target=_worker, args=(r, world, init_file, tmp, fn, args), daemon=False)
            for r in range(world)
        ]
        hung = run_processes(procs, timeout)
        results = []
        errors = []
        for r in range(world):
            path = os.path.join(tmp, f"{r}.pt")
            if not os.path.exists(path):
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode}, hung={hung[r]})")
                continue
            data = torch.load(path, weights_only=False)
            if data["ok"]:
                results.append(data["result"])
            else:
                errors.append(f"rank {r}:\n{data['error']}")
        if errors:
            raise AssertionError("distributed run failed:\n" + "\n".join(errors))
        return results
