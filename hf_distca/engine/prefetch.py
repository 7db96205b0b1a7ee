"""Planning the next micro-batch in a background process, while this one computes.

:func:`hf_distca.engine.prepare.prepare` plans through :class:`PlanContext` (everything a plan depends on
besides the pieces) and remembers the contexts it planned with in the engine state's :class:`Prefetcher`.
:meth:`Prefetcher.prefetch_plans`, called by the data path with the next micro-batch's layout, submits that layout's plan for each remembered context to one
worker process (a process: the greedy planner is pure Python and would hold this process's GIL), under the
exact cache key the engine computes; the engine's next cache miss takes the plan from there instead of
planning. A plan is a pure function of its inputs, so a prefetched plan is the plan the engine would make
(tests check this). Rank-local: no collective runs here, and which plans were prefetched never changes
which collectives run.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.util
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from hf_distca.config import DistCAConfig
from hf_distca.engine.consistency import Pieces, digest64, normalize_pieces
from hf_distca.planning import CorePlan, attention_flops_per_pair, plan_core_attention

_CONTEXTS = 8  # contexts remembered (e.g. one per window of a model with local and global layers)
_PENDING = 32  # prefetched plans kept until taken (a micro-batch's nano-batches x contexts, ahead)


@dataclass(frozen=True)
class PlanContext:
    """What a plan depends on besides the pieces: one engine call's shapes, config and cost model."""

    rank: int
    world: int
    q_heads: int
    kv_heads: int
    head_dim: int
    elem: int
    """Bytes per element of q, k and v."""
    config: DistCAConfig
    cost_model: Any
    window: int | None

    def key(self, digest: int) -> tuple:
        """The plan cache key of the pieces of digest ``digest`` (:func:`pieces_digest`) in this context."""
        # the cost model's repr carries its table's hash: a table rewritten in place, or the one "auto"
        # resolved to, is part of the key
        return (
            digest, self.rank, self.world, self.q_heads, self.kv_heads, self.head_dim, self.elem,
            self.config.plan_fields(), repr(self.cost_model), self.window,
        )  # fmt: skip

    def common_key(self, digest: int) -> tuple:
        """:meth:`key` without this rank's number: the same on every rank planning the same inputs."""
        key = self.key(digest)
        return (key[0], *key[2:])

    def plan(self, all_pieces: list[Pieces]) -> CorePlan:
        """The plan of ``all_pieces`` (every rank's normalized pieces) in this context."""
        return plan_core_attention(
            all_pieces,
            q_row_bytes=self.q_heads * self.head_dim * self.elem,
            kv_row_bytes=2 * self.kv_heads * self.head_dim * self.elem,
            options=self.config.planner_options(),
            cost_model=self.cost_model,
            flops_per_pair=attention_flops_per_pair(self.q_heads, self.head_dim),
            window=self.window,
        )


def pieces_digest(all_pieces: list[Pieces]) -> int:
    """The digest the engine keys plans by: of every rank's normalized pieces' digests."""
    return digest64([digest64(p) for p in all_pieces])


class Prefetcher:
    """The plans made ahead in one background worker process, and that process (one per
    :class:`hf_distca.engine.state.EngineState`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._contexts: OrderedDict[tuple, PlanContext] = OrderedDict()
        """The contexts the engine planned in, the latest last (at most ``_CONTEXTS``)."""
        self._pending: OrderedDict[tuple, Future] = OrderedDict()
        """Submitted plans by plan key, until taken (at most ``_PENDING``)."""
        self._executor: ProcessPoolExecutor | None = None
        self._started: Future = Future()
        """Done once the worker process has started and imported the planner (never before a worker exists)."""

    def remember(self, context: PlanContext) -> None:
        """Record ``context`` as one the next micro-batches will be planned in (the engine, at each plan)."""
        name = context.key(0)[1:]  # the key without the pieces' digest
        with self._lock:
            self._contexts[name] = context
            self._contexts.move_to_end(name)
            if len(self._contexts) > _CONTEXTS:
                self._contexts.popitem(last=False)

    def take(self, key: tuple) -> CorePlan | None:
        """The prefetched plan of ``key``, waiting for it if it is still being planned; None if none was
        submitted, the worker has not started yet, or its planning failed (the caller then plans inline,
        raising any error there)."""
        with self._lock:
            future = self._pending.pop(key, None)
        if future is None or not self._started.done():  # inline planning does not wait for the worker's start
            return None
        try:
            return future.result()
        except Exception:  # e.g. the worker died: planning inline gives the plan, or the real error
            return None

    def prefetch_plans(self, all_pieces: Sequence[Sequence[Sequence[int]]]) -> int:
        """Submit the plans of ``all_pieces`` (every rank's pieces of one coming micro-batch or nano-batch)
        in each context the engine planned in so far, to the background worker; returns how many were
        submitted (0 before the engine's first plan, and for contexts of another group size)."""
        normalized = [normalize_pieces(p, f"all_pieces[{r}]") for r, p in enumerate(all_pieces)]
        digest = pieces_digest(normalized)
        submitted = 0
        with self._lock:
            for context in list(self._contexts.values()):
                key = context.key(digest)
                if context.world != len(normalized) or key in self._pending:
                    continue
                try:
                    self._pending[key] = self._worker().submit(_plan, context, normalized)
                except (
                    BrokenProcessPool
                ):  # the worker died (its plans fall back to inline): a new one next time
                    self._shutdown_locked()
                    break
                submitted += 1
                while len(self._pending) > _PENDING:
                    self._pending.popitem(last=False)[1].cancel()
        return submitted

    def start(self, wait: bool = False) -> None:
        """Start the background worker now: it takes seconds to start (a fresh interpreter importing
        hf_distca), best overlapped with the model's set-up. Until it has started, the engine plans inline
        rather than wait for it; ``wait=True`` returns once it has started (then every plan submitted
        from now on is taken from it)."""
        with self._lock:
            self._worker()
            started = self._started
        if wait:
            started.result()

    def forget(self) -> None:
        """Drop the remembered contexts and the plans not taken yet (the worker keeps running)."""
        with self._lock:
            self._contexts.clear()
            for future in self._pending.values():
                future.cancel()
            self._pending.clear()

    def stop(self) -> None:
        """Stop the background worker, dropping the plans not taken yet (the next prefetch starts a new
        one). Runs at the exit of a process that started one (a multiprocessing child's too)."""
        with self._lock:
            self._shutdown_locked()

    def _worker(self) -> ProcessPoolExecutor:
        """The one background planning process (started at the first prefetch; called under the lock)."""
        if self._executor is None:
            self._executor = ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn")
            )
            self._started = self._executor.submit(_import)  # the process starts at the first submission
            # multiprocessing's exit handler (at interpreter exit, and at the end of a multiprocessing child,
            # which skips atexit) runs this before it closes the executor's queues (finalizers of priority
            # 10) and joins this process's children: the worker waits for work until told to stop
            multiprocessing.util.Finalize(None, self.stop, exitpriority=100)
        return self._executor

    def _shutdown_locked(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)  # a plan being made finishes first


def _plan(context: PlanContext, all_pieces: list[Pieces]) -> CorePlan:
    return context.plan(all_pieces)


def _import() -> None:
    """Nothing: the worker imports this module (and the planner) to run it, so that it is done once the
    worker can plan."""
