"""The engine's state: everything it remembers between calls, in one object with one reset.

:class:`EngineState` holds the plan cache, the layouts already checked across ranks, the probes' results
(link bandwidth, kernel-cost tables), the compiled attention ops' registry and runners, and the plan
prefetcher with its worker process. The process has one (:func:`engine_state`): the runtime of every
model holds it (:class:`hf_distca.attention.DistCARuntime`), and the engine's functions take it as
``state`` (None: this one), so that a test can hand them a fresh one. Nothing else in the engine keeps
state between calls. Groups are named by their members (:func:`group_key`), never by object identity.
"""

from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from hf_distca.engine.prefetch import Prefetcher

__all__ = ["EngineState", "GroupKey", "engine_state", "group_key"]

PLAN_CACHE_SIZE = 8
"""Prepared micro-batches kept (the layers of one micro-batch hit: its nano-batches, its sliding windows)."""
CHECKED_LAYOUTS = 16
"""Layout objects remembered as checked across ranks."""
COMPARED_PLANS = 32
"""Plans remembered as compared across ranks (a micro-batch's nano-batches x windows, a few ahead)."""
RUNNER_CACHE_SIZE = 16
"""Runners of the compiled attention ops kept."""

SIDE_STREAM_PRIORITY = -64
"""Below every CUDA device's priority range (lower is higher): torch clamps it to the highest priority."""

GroupKey = tuple[int, ...]


def group_key(group: Any) -> GroupKey:
    """The global ranks of ``group`` (None: the world), which name it; () without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return ()
    return tuple(dist.get_process_group_ranks(dist.group.WORLD if group is None else group))


@dataclass
class CheckedLayout:
    """One ``all_pieces`` object whose inputs the ranks of a group checked against each other."""

    obj: Any
    """The caller's object (found again by identity; held, so that it stays the same object)."""
    group: GroupKey
    all_pieces: list
    """Every rank's normalized pieces."""
    digest: int


@dataclass
class EngineState:
    """What the engine remembers between calls (see the module docstring). Rank-local."""

    plans: OrderedDict[tuple, Any] = field(default_factory=OrderedDict)
    """Prepared micro-batches (:class:`~hf_distca.engine.prepare.PreparedAttention`) by plan key, the
    latest last, at most :data:`PLAN_CACHE_SIZE`."""
    checked_layouts: list[CheckedLayout] = field(default_factory=list)
    """The layout objects checked across ranks, the latest last, at most :data:`CHECKED_LAYOUTS`; every
    rank of a group checks the same objects at the same calls, so :meth:`reset` keeps them."""
    compared_plans: OrderedDict[tuple, None] = field(default_factory=OrderedDict)
    """The plans whose digests the ranks of a group compared, by group and plan key without the rank,
    the latest last, at most :data:`COMPARED_PLANS`; like :attr:`checked_layouts`, every rank of a group
    meets the same keys in the same order, so :meth:`reset` keeps them."""
    link_gib_per_s: dict[GroupKey, float] = field(default_factory=dict)
    """The link probe's figure per group (:func:`hf_distca.engine.link_probe.probe_link`)."""
    cost_tables: dict[tuple, Any] = field(default_factory=dict)
    """The kernel-cost probe's table (a :class:`~hf_distca.planning.MeasuredCost`, or None: causal pairs)
    per (group, device type, backend, dtype, q heads, kv heads, head dim)
    (:func:`hf_distca.engine.cost_probe.probe_cost_table`)."""
    measurement_seconds: float | None = None
    """Wall-clock seconds of this process's latest start-up kernel measurement; None before any."""
    runners: OrderedDict[tuple, tuple[Any, Any]] = field(default_factory=OrderedDict)
    """(runner, prepared) of the compiled attention ops (:mod:`hf_distca.engine.compiled`) by layout,
    runtime, scale, window and shapes, the latest last, at most :data:`RUNNER_CACHE_SIZE`."""
    names: itertools.count = field(default_factory=lambda: itertools.count(1))
    """The integer names handed to layouts and runtimes for the compiled ops."""
    layouts: weakref.WeakValueDictionary[int, Any] = field(default_factory=weakref.WeakValueDictionary)
    """Layouts by the name their token carries (held weakly: the batch keeps its layout alive)."""
    runtimes: weakref.WeakValueDictionary[int, Any] = field(default_factory=weakref.WeakValueDictionary)
    """Runtimes by their key (held weakly: the model keeps its runtime alive)."""
    prefetcher: Prefetcher = field(default_factory=Prefetcher)
    """The plans made ahead in a background process, and that process."""
    forward_inputs: dict[str, Any] = field(default_factory=dict)
    """The attention function's document boundaries of the last forward, one slot per kind, reused by
    the forward's other layers (:mod:`hf_distca.attention_inputs`)."""
    side_streams: dict[str, Any] = field(default_factory=dict)
    """The CUDA stream per device on which a chained exchange's later stages start (the KV relay's second
    all-to-all, :func:`hf_distca.comm.chain`), made at high priority at its first use and kept by
    :meth:`reset` (nothing in it is derived from inputs)."""

    def reset(self) -> None:
        """Forget what was derived from inputs: plans, compiled runners, prefetched plans and the attention
        function's document boundaries (the next call
            plans again; the prefetch worker keeps running). Rank-local and safe on any subset of ranks: what
            the ranks agreed on together (checked layouts, compared plans, probe results) is kept, so no rank runs a collective
            the others skip; probe again to measure again."""
        self.plans.clear()
        self.runners.clear()
        self.forward_inputs.clear()
        self.prefetcher.forget()

    def side_stream(self, device: Any) -> Any:
        """The side stream of CUDA ``device`` (see :attr:`side_streams`)."""
        import torch

        key = str(device)
        if key not in self.side_streams:
            # the highest priority the device has (torch maps a lower number than its range to the highest):
            # a relay's second stage is on the critical path of the layer that waits for it
            self.side_streams[key] = torch.cuda.Stream(device, priority=SIDE_STREAM_PRIORITY)
        return self.side_streams[key]

    def name(self, obj: Any, registry: weakref.WeakValueDictionary[int, Any]) -> int:
        """A new integer name of ``obj`` in ``registry`` (:attr:`layouts` or :attr:`runtimes`)."""
        key = next(self.names)
        registry[key] = obj
        return key


_process_state: EngineState | None = None


def engine_state() -> EngineState:
    """The process's engine state (made at the first call)."""
    global _process_state
    if _process_state is None:
        _process_state = EngineState()
    return _process_state
