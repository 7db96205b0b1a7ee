"""Every rank's collectives replayed on the CPU: each rank of a step runs alone, in its own process, on a
recording process group, and the logs of all ranks are compared afterwards.

The recording group (:class:`RecordingGroup`, registered as the ``replay`` backend) completes every
collective at once, without any other rank: an all-to-all's output is filled with ``fill`` (the data is
not what the peers would send), an all-gather's output holds this rank's input in every slot (what the
consistency check sees when the ranks agree), an all-reduce and a broadcast leave the tensor as it is.
Each call is logged: the operation, the group's size, dtype, shapes, reduce op, and for an all-to-all the
split sizes sent to and expected from each peer. :func:`trace_plans` adds the digest of every plan the
engine prepares to the same log.

The engine is built to plan deterministically from data every rank holds (the layout of the micro-batch,
the config), so which collectives a rank issues and with which splits must not depend on what the peers
send: a rank run alone then issues exactly what it would issue in a real run. :func:`check_logs` then
demands what a real run needs of its ranks: the same sequence of collectives on every rank, all-to-all
splits that match pairwise (what rank a sends to b is what b expects from a), local splits that add up to
the buffers, and the same plan digests. A rank that diverges (a different layout, config, a link probe
that sends more than its peer expects) hangs or misroutes rows on a real group; here it is a message.

Ranks run as processes forked from a preloaded server (:func:`tests.distributed.preloaded_context`),
``parallel`` at a time: the engine keeps per-process state (plan caches, measured links), so two ranks
must never share a process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from distributed import preloaded_context
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

BACKEND = "replay"
A2A = "all_to_all_single"
PER_RANK_KEYS = ("send", "recv", "in_numel", "out_numel")
"""Entries of an all-to-all's record that differ between ranks by design (checked pairwise instead)."""

_log: list[dict] = []
_fill = 0.0


def _done() -> Any:
    future: Future = Future()
    future.set_result(None)
    return _create_work_from_future(future)


def _reduce_name(opts: Any) -> str:
    op = getattr(opts, "reduceOp", None)
    return str(getattr(op, "op", op))


class RecordingGroup(dist.ProcessGroup):
    """A process group of ``world`` ranks of which only this one exists: every collective is logged and
    completes at once (see the module docstring for what its outputs hold). Collectives it does not model
    raise (the base class's), so nothing passes unrecorded."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__(rank, world)
        self._rank, self._world = rank, world

    def size(self) -> int:
        return self._world

    def getBackendName(self) -> str:  # noqa: N802 - the ProcessGroup interface
        return BACKEND

    def _record(self, op: str, **fields: Any) -> None:
        _log.append({"op": op, "world": self._world, **fields})

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # noqa: A002
        send = _splits(input_split_sizes, input.numel(), self._world)
        recv = _splits(output_split_sizes, output.numel(), self._world)
        self._record(A2A, dtype=str(input.dtype), send=send, recv=recv, in_numel=input.numel(),
                     out_numel=output.numel())  # fmt: skip
        output.fill_(_fill if output.is_floating_point() else int(_fill == _fill and _fill != 0))  # NaN: 0
        return _done()

    def allgather(self, output_tensors, input_tensors, opts=None):
        outs, mine = output_tensors[0], input_tensors[0]
        self._record("all_gather", dtype=str(mine.dtype), shape=list(mine.shape),
                     out_shapes=[list(t.shape) for t in outs])  # fmt: skip
        for out in outs:
            out.copy_(mine)
        return _done()

    def all_gather_single(self, output_tensor, input_tensor, opts=None):
        self._record("all_gather_into_tensor", dtype=str(input_tensor.dtype), shape=list(input_tensor.shape),
                     out_shape=list(output_tensor.shape))  # fmt: skip
        for chunk in output_tensor.chunk(self._world):
            chunk.copy_(input_tensor.reshape(chunk.shape))
        return _done()

    def allreduce(self, tensors, opts=None):
        self._record("all_reduce", dtype=str(tensors[0].dtype), shape=list(tensors[0].shape),
                     reduce=_reduce_name(opts))  # fmt: skip
        return _done()

    def broadcast(self, tensors, opts=None):
        root = getattr(opts, "rootRank", None)
        self._record("broadcast", dtype=str(tensors[0].dtype), shape=list(tensors[0].shape), root=root)
        return _done()

    def barrier(self, opts=None):
        self._record("barrier")
        return _done()


def _splits(given: list[int] | None, numel: int, world: int) -> list[int]:
    """The split sizes of an all-to-all buffer (equal parts when none are given, as torch splits it)."""
    if given:
        return [int(s) for s in given]
    return [numel // world] * world


def _create(prefix_store: Any, rank: int, world: int, timeout: Any) -> RecordingGroup:
    return RecordingGroup(rank, world)


if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])


@contextlib.contextmanager
def trace_plans() -> Iterator[None]:
    """Inside, every plan the engine prepares (every attention call: a cache hit too) is logged as
    ``{"op": "plan", "digest": ...}`` in the sequence of collectives."""
    from hf_distca.engine import op

    prepare = op.prepare

    def traced(*args: Any, **kwargs: Any) -> Any:
        prepared = prepare(*args, **kwargs)
        _log.append({"op": "plan", "digest": prepared.plan.digest(), "window": prepared.window})
        return prepared

    op.prepare = traced
    try:
        yield
    finally:
        op.prepare = prepare


# ------------------------------------------------------------------------------------ running ranks
def _run_rank(rank: int, world: int, out: str, fn: Callable, args: tuple) -> None:
    """In a rank's process: ``fn``'s sections of this rank's log, or its error, as JSON in ``out``."""
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world)
    sections: dict[str, list[dict]] = {}
    error = None
    try:
        for name, log in fn(rank, world, *args):
            sections[name] = log
    except Exception as err:  # noqa: BLE001 - reported to the parent, which fails on it
        error = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
    finally:
        dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"sections": sections, "error": error}, f)


def _serve(
    world: int, out_dir: str, fill: float, fn: Callable, args: tuple, parallel: int, warm: Callable | None
) -> None:
    """The ranks' server: imports what the ranks need once (``warm()``), then forks one process per rank,
    ``parallel`` at a time (a rank starts in milliseconds instead of importing Transformers again)."""
    global _fill
    os.setsid()  # its own process group: the parent kills it, and the ranks, on a timeout
    torch.set_num_threads(1)  # before any parallel region: the forked ranks run on one thread each
    _fill = fill
    if warm is not None:
        warm()
    running: set[int] = set()
    for rank in range(world):
        while len(running) >= parallel:
            running.discard(os.wait()[0])
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _run_rank(rank, world, os.path.join(out_dir, f"{rank}.json"), fn, args)
            except BaseException:  # noqa: BLE001 - the parent reports the missing log
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        running.add(pid)
    while running:
        running.discard(os.wait()[0])


def step_log(run: Callable[[], Any]) -> list[dict]:
    """The log of what ``run()`` issues on this rank (collectives and plans)."""
    del _log[:]
    with trace_plans():
        run()
    return list(_log)


def replay(
    fn: Callable,
    world: int,
    *args: Any,
    parallel: int = 2,
    fill: float = 0.0,
    warm: Callable | None = None,
    timeout: float = 600.0,
) -> dict[str, list[list[dict]]]:
    """Run ``fn(rank, world, *args)`` for every rank in its own process on a recording group of ``world``
    ranks, ``parallel`` processes at a time. ``fn`` (importable, module level) yields ``(name, log)``
    pairs, each log from :func:`step_log`; ``warm`` (importable): run once before the ranks fork. Returns
    ``{name: [rank 0's log, rank 1's, ...]}``; raises with the rank's traceback when one failed."""
    with tempfile.TemporaryDirectory() as tmp:
        server = preloaded_context().Process(target=_serve, args=(world, tmp, fill, fn, args, parallel, warm))
        server.start()
        server.join(timeout)
        if server.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.join()
            raise AssertionError(f"replay of {world} ranks ran past {timeout} s")
        results = []
        for r in range(world):
            path = os.path.join(tmp, f"{r}.json")
            if not os.path.exists(path):
                raise AssertionError(
                    f"replay: rank {r} of {world} left no log (server exit code {server.exitcode})"
                )
            with open(path) as f:
                results.append(json.load(f))
    errors = [f"rank {r}: {res['error']}" for r, res in enumerate(results) if res["error"]]
    if errors:
        raise AssertionError(f"replay of {world} ranks failed:\n" + "\n".join(errors[:3]))
    names = list(results[0]["sections"])
    return {name: [res["sections"].get(name, []) for res in results] for name in names}


# ------------------------------------------------------------------------------------ the checker
def _signature(entry: dict) -> str:
    return json.dumps({k: v for k, v in entry.items() if k not in PER_RANK_KEYS}, sort_keys=True)


def _by_value(values: list[str]) -> str:
    groups: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(v, []).append(r)
    return "; ".join(f"{v} on rank(s) {_ranks(rs)}" for v, rs in groups.items())


def _ranks(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 8 else f"[{ranks[0]}..{ranks[-1]}] ({len(ranks)} ranks)"


def check_logs(logs: list[list[dict]], limit: int = 5) -> list[str]:
    """What stops ``logs`` (one per rank, in rank order) from being one run of a real group: call ``i``
    that differs between ranks (operation, group size, dtype, shapes of gathered or reduced tensors,
    plan digest; the first such call only, as everything after it is out of step), all-to-all splits
    that disagree pairwise or with the buffers. At most ``limit`` problems of each kind. An empty list:
    the ranks agree."""
    world = len(logs)
    problems: list[str] = []
    mismatched: list[str] = []
    for i in range(max(len(log) for log in logs)):
        entries = [log[i] if i < len(log) else None for log in logs]
        signatures = ["<no call: the log ended>" if e is None else _signature(e) for e in entries]
        if len(set(signatures)) > 1:
            problems.append(f"call {i} differs between ranks: {_by_value(signatures)}")
            break
        if entries[0]["op"] != A2A:
            continue
        for a, e in enumerate(entries):
            if sum(e["send"]) != e["in_numel"] or sum(e["recv"]) != e["out_numel"] or len(e["send"]) != world:
                problems.append(
                    f"call {i} ({A2A}) on rank {a}: splits {e['send']} / {e['recv']} do not describe "
                    f"buffers of {e['in_numel']} / {e['out_numel']} elements over {world} ranks"
                )
        for a in range(world):
            for b in range(world):
                sent, expected = entries[a]["send"][b], entries[b]["recv"][a]
                if sent != expected:
                    mismatched.append(
                        f"call {i} ({A2A}): rank {a} sends {sent} elements to rank {b}, which expects {expected}"
                    )
    problems = problems[:limit] + mismatched[:limit]
    if len(mismatched) > limit:
        problems.append(f"... {len(mismatched) - limit} more split mismatches")
    return problems


def summary(logs: list[list[dict]]) -> dict[str, int]:
    """How many calls of each kind rank 0 issued (what the test asserts the step really exercised)."""
    counts: dict[str, int] = {}
    for entry in logs[0]:
        counts[entry["op"]] = counts.get(entry["op"], 0) + 1
    return counts
