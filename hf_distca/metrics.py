"""Engine metrics, accumulated between resets (the callback resets once per optimizer step).

FLOPs are forward core-attention FLOPs (4 x heads x head_dim per causal (query, key) pair) summed
over layers and micro-batches, per server: ``flops_before`` without balancing (each rank its own
pieces), ``flops_after`` as planned. ``bytes_sent`` (``bytes_received``) counts every byte this
rank sent (received) for core attention: dispatch and return in forward, their mirrors in backward,
and any recompute; ``phase_bytes`` the same per phase of the traffic ledger
(:data:`hf_distca.planning.traffic.PHASES`, as the engine's stages name their exchanges). ``attn_fwd_kernels`` counts core-attention forward kernel runs on this rank (one per
engine call that has work for this server, one per local call); a rematerialization-aware recompute
(:mod:`hf_distca.engine.remat`) runs none and counts as ``attn_replays`` instead.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field


@dataclass
class EngineStats:
    calls: int = 0
    """Forward calls of the engine that ran core attention (layers x micro-batches, plus plain recomputes)."""
    attn_fwd_kernels: int = 0
    """Core-attention forward kernel runs on this rank (engine server kernels and local attention)."""
    attn_replays: int = 0
    """Recomputes that reused a saved attention output instead of running attention again."""
    plans: int = 0
    """Plans computed (cache misses)."""
    plans_prefetched: int = 0
    """Of ``plans``, those planned ahead in the background (:mod:`hf_distca.engine.prefetch`)."""
    checks: int = 0
    """Cross-rank consistency checks of the engine's inputs (one small all-gather each)."""
    flops_before: list[float] = field(default_factory=list)
    flops_after: list[float] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    phase_bytes: dict[str, list[int]] = field(default_factory=dict)
    """Phase name -> [bytes sent, bytes received] (exchanges started without a phase name: not here)."""
    exchanges: int = 0
    """All-to-all-v exchanges started (two per phase that carries KV through the relay)."""
    plan_seconds: float = 0.0
    """Seconds the engine's thread spent on plans: planning, or waiting for a prefetched plan, and
    building the dispatch index (the critical-path cost of planning)."""
    probes: int = 0
    """Start-up probe rounds run (link and kernel cost: :func:`hf_distca.engine.probes.probe`, collective,
    before the first engine call; never inside a layer's call)."""
    probe_seconds: float = 0.0
    """Seconds those probes took (measuring, and the collectives that agree on the results)."""


_lock = threading.Lock()
_stats = EngineStats()


def record_call(flops_before: list[float], flops_after: list[float]) -> None:
    with _lock:
        _stats.calls += 1
        if len(_stats.flops_before) != len(flops_before):
            _stats.flops_before = [0.0] * len(flops_before)
            _stats.flops_after = [0.0] * len(flops_after)
        for i, (b, a) in enumerate(zip(flops_before, flops_after)):
            _stats.flops_before[i] += b
            _stats.flops_after[i] += a


def record_forward_kernel() -> None:
    with _lock:
        _stats.attn_fwd_kernels += 1


def record_replay() -> None:
    with _lock:
        _stats.attn_replays += 1


def record_check() -> None:
    with _lock:
        _stats.checks += 1


def record_plan(seconds: float, prefetched: bool = False) -> None:
    with _lock:
        _stats.plans += 1
        _stats.plans_prefetched += int(prefetched)
        _stats.plan_seconds += seconds


def record_probe(seconds: float) -> None:
    with _lock:
        _stats.probes += 1
        _stats.probe_seconds += seconds


def record_bytes(sent: int, received: int, phase: str | None = None) -> None:
    """Count one exchange's bytes (under ``phase`` too, when it has a name)."""
    with _lock:
        _stats.bytes_sent += sent
        _stats.bytes_received += received
        _stats.exchanges += 1
        if phase is not None:
            counts = _stats.phase_bytes.setdefault(phase, [0, 0])
            counts[0] += sent
            counts[1] += received


def snapshot(reset: bool = False) -> EngineStats:
    """A copy of the statistics so far; ``reset=True`` starts a new accumulation."""
    global _stats
    with _lock:
        s = copy.deepcopy(_stats)
        if reset:
            _stats = EngineStats()
    return s


def reset() -> None:
    snapshot(reset=True)
