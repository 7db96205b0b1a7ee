"""The engine's schedules of one micro-batch as plain data, and a list scheduler that times them (the
simulator's; NumPy only).

A schedule is the ordered list of operations every rank runs for one micro-batch (all ranks run the same
list; only the durations differ): compute on the rank's one compute stream, and the start of and the wait
for each all-to-all phase of the traffic ledger (:data:`hf_distca.planning.traffic.PHASES`). Three
schedules, built by pure functions:

- serial (:func:`serial`, ``DistCAConfig(ping_pong=False)``): per layer forward ``pre(l)`` (norm, QKV,
  RoPE), the attention call (dispatch, wait, kernel, return, wait: blocking), ``post(l)`` (o_proj, MLP);
  backward mirrored: ``post(l)`` backward (with checkpointing: the layer's recomputed forward first), the
  backward attention call, ``pre(l)`` backward.
- attention-level ping-pong (:func:`serial` with several ``parts``, the engine's PingPongRunner over
  :func:`hf_distca.planning.ping_pong.part_plans`): inside one attention call, every part's dispatch is started,
  then per part: wait for its dispatch, its kernel, start its return; then every part's return is waited
  for. Messages hide only behind kernels of the same call.
- layer-level ping-pong (:func:`layer_ping_pong`): two nano-batches of documents, each with its own plan,
  run through the layers as coroutines that switch at the attention function: while one's messages fly,
  the other runs its projections and MLP (forward), or its layer backward.

Operation names: compute ``pre``, ``post`` (forward), ``post_bwd`` (recompute + backward of o_proj and MLP),
``pre_bwd``, ``kernel`` (forward or backward by the pass), ``head`` (embedding, LM head, loss and their
backward, optimizer: the per-token fixed work); communication ``start``/``wait`` of a phase. The attention
call's operations carry the engine's profiler stage names (:func:`engine_stage`, ``fwd.dispatch.0`` ...).

The list scheduler (:func:`run_schedule`): per rank one compute stream and one communication channel;
every all-to-all is a collective that starts once every rank has started it and the previous collective
has finished, and lasts as long as the slowest rank's transfer (one duration per collective, from the link
model); a wait blocks the rank's compute stream until the collective has finished. All ranks run the same
list, so collectives run in list order and one pass over the list, vectorised over ranks, times it.
A phase that moves nothing on any rank is no collective (the engine then starts nothing): it neither
synchronises nor takes time. Pure Python/NumPy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "COMPUTE",
    "Op",
    "ScheduleTiming",
    "attention_call",
    "engine_stage",
    "layer_ping_pong",
    "run_schedule",
    "serial",
]

COMPUTE = ("pre", "post", "post_bwd", "pre_bwd", "kernel", "head", "pre_recompute")
"""Names of compute operations (``pre_recompute``: plain recompute's forward of pre(l) in backward, before
the recomputed attention call)."""


@dataclass(frozen=True)
class Op:
    """One operation of a schedule."""

    kind: str
    """'compute', 'start' (an all-to-all is started, asynchronous) or 'wait' (the compute stream waits)."""
    name: str
    """A compute name (:data:`COMPUTE`) or a phase of the traffic ledger ('fwd.dispatch', ...)."""
    pass_: str
    """'fwd' or 'bwd': the pass of the attention call (compute: of the layer's work)."""
    layer: int
    nano: int = 0
    """The nano-batch (layer-level ping-pong; 0 otherwise)."""
    part: int = 0
    """The part of the attention call (attention-level ping-pong; 0 with one part)."""
    parts: int = 1
    """How many parts the attention call has (for the engine's stage names)."""
    call: int = 0
    """Which attention call of the layer and pass: 1 for plain recompute's forward call in backward."""

    @property
    def key(self) -> tuple:
        """What the duration depends on: (name, pass, nano, part) (every layer costs the same)."""
        return (self.name, self.pass_, self.nano, self.part)

    @property
    def collective(self) -> tuple:
        """The identity of a start/wait's collective."""
        return (self.name, self.pass_, self.layer, self.nano, self.part, self.call)


def engine_stage(op: Op) -> str | None:
    """The engine's profiler range of an attention-call operation (``distca.`` + this, see
    hf_distca.engine.op), e.g. ``fwd.dispatch.1``, ``bwd.wait_return``; None for layer work."""
    if op.kind == "compute" and op.name != "kernel":
        return None
    if op.kind == "compute":
        stage = f"{op.pass_}.compute"
    else:
        what = op.name.split(".")[1]  # dispatch | return
        stage = f"{op.pass_}.{what}" if op.kind == "start" else f"{op.pass_}.wait_{what}"
    return stage if op.parts == 1 else f"{stage}.{op.part}"


def attention_call(pass_: str, layer: int, parts: int = 1, nano: int = 0, call: int = 0) -> list[Op]:
    """One attention call as the engine's PingPongRunner runs it: every part's dispatch started; per
    part: wait for it, its kernel, start its return; then wait for every part's return. One part: the
    serial call (dispatch, wait, kernel, return, wait)."""
    dispatch, ret = f"{pass_}.dispatch", f"{pass_}.return"

    def op(kind: str, name: str, j: int) -> Op:
        return Op(kind, name, pass_, layer, nano, j, parts, call)

    ops = [op("start", dispatch, j) for j in range(parts)]
    for j in range(parts):
        ops += [op("wait", dispatch, j), op("compute", "kernel", j), op("start", ret, j)]
    return ops + [op("wait", ret, j) for j in range(parts)]


def _compute(name: str, pass_: str, layer: int, nano: int = 0) -> Op:
    return Op("compute", name, pass_, layer, nano)


def serial(layers: int, parts: int = 1, recompute: str = "remat") -> list[Op]:
    """Serial layers of one micro-batch, each attention call in ``parts`` parts (1: the serial engine;
    more: attention-level ping-pong). ``recompute``: 'remat' (rematerialization-aware checkpointing: the
    attention is not run again in backward) or 'full' (plain recompute: backward runs the layer's
    forward attention call again, with its exchanges, before the layer's backward)."""
    _check(layers, recompute)
    ops: list[Op] = []
    for layer in range(layers):
        ops.append(_compute("pre", "fwd", layer))
        ops += attention_call("fwd", layer, parts)
        ops.append(_compute("post", "fwd", layer))
    ops.append(_compute("head", "fwd", layers))
    for layer in reversed(range(layers)):
        if recompute == "full":
            ops.append(_compute("pre_recompute", "bwd", layer))
            ops += attention_call("fwd", layer, parts, call=1)
        ops.append(_compute("post_bwd", "bwd", layer))
        ops += attention_call("bwd", layer, parts)
        ops.append(_compute("pre_bwd", "bwd", layer))
    return ops


def layer_ping_pong(layers: int, nanos: int = 2) -> list[Op]:
    """Layer-level ping-pong of ``nanos`` nano-batches (each attention call in one part), with
    rematerialization-aware checkpointing, in the engine's order (hf_distca/engine/layer_op.py; asserted
    against the engine's recorded stages by tests/test_layer_ping_pong.py). Forward, per layer l: each
    nano in turn waits for its dispatch, runs its kernel and starts its return; then each nano in turn
    waits for its return, runs post(l), pre(l + 1) and starts its next dispatch. Backward runs the
    engine's nodes in exactly reverse creation order, nanos in reverse: each nano runs post(top) backward
    (its recompute first) and starts its backward dispatch; then per layer l from the last, each nano waits
    for its dispatch, runs its backward kernel and starts its return; then each nano in turn waits for its
    return, runs pre(l) backward, post(l - 1) backward and starts its next backward dispatch, so a return
    flies while the other nanos run a whole layer's backward."""
    _check(layers, "remat")
    if nanos < 1:
        raise ValueError(f"nanos must be >= 1, got {nanos}")
    order = list(range(nanos))

    def serve(pass_: str, layer: int, n: int) -> list[Op]:
        """Nano-batch n's attention call of ``pass_``: wait for its dispatch, its kernel, start its return."""
        return [
            Op("wait", f"{pass_}.dispatch", pass_, layer, n),
            _compute("kernel", pass_, layer, n),
            Op("start", f"{pass_}.return", pass_, layer, n),
        ]

    ops: list[Op] = []
    for n in order:
        ops += [_compute("pre", "fwd", 0, n), Op("start", "fwd.dispatch", "fwd", 0, n)]
    for layer in range(layers):
        for n in order:
            ops += serve("fwd", layer, n)
        for n in order:
            ops += [Op("wait", "fwd.return", "fwd", layer, n), _compute("post", "fwd", layer, n)]
            if layer + 1 < layers:
                ops += [
                    _compute("pre", "fwd", layer + 1, n),
                    Op("start", "fwd.dispatch", "fwd", layer + 1, n),
                ]
    ops += [_compute("head", "fwd", layers, n) for n in order]
    back = order[::-1]
    top = layers - 1
    for n in back:
        ops += [_compute("post_bwd", "bwd", top, n), Op("start", "bwd.dispatch", "bwd", top, n)]
    for layer in reversed(range(layers)):
        for n in back:
            ops += serve("bwd", layer, n)
        for n in back:
            ops += [Op("wait", "bwd.return", "bwd", layer, n), _compute("pre_bwd", "bwd", layer, n)]
            if layer > 0:
                ops += [
                    _compute("post_bwd", "bwd", layer - 1, n),
                    Op("start", "bwd.dispatch", "bwd", layer - 1, n),
                ]
    return ops


def _check(layers: int, recompute: str) -> None:
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    if recompute not in ("remat", "full"):
        raise ValueError(f"recompute must be 'remat' or 'full', got {recompute!r}")


# ---------------------------------------------------------------------------------------- the scheduler
@dataclass
class ScheduleTiming:
    """What :func:`run_schedule` found for one schedule."""

    finish: np.ndarray
    """(ranks,) seconds at which each rank's compute stream ends."""
    busy: np.ndarray
    """(ranks,) seconds of compute."""
    exposed: dict[str, np.ndarray] = field(default_factory=dict)
    """Phase -> (ranks,) seconds the rank's compute stream waited while that phase's transfers ran (not
    the wait for other ranks to start them)."""
    comm: dict[str, float] = field(default_factory=dict)
    """Phase -> seconds of its collectives, summed."""

    @property
    def step(self) -> float:
        """Seconds until the last rank ends (ranks meet at the gradient reduction)."""
        return float(self.finish.max()) if self.finish.size else 0.0


def run_schedule(
    ops: Sequence[Op],
    compute: Mapping[tuple, np.ndarray],
    comm: Mapping[tuple, float],
    ranks: int,
) -> ScheduleTiming:
    """Time ``ops`` on ``ranks`` ranks. ``compute[op.key]``: (ranks,) seconds of a compute op (missing:
    0); ``comm[op.key]``: seconds of a start's collective (missing or 0: no collective, the phase moves
    nothing). Every wait must follow its start."""
    t = np.zeros(ranks)
    busy = np.zeros(ranks)
    channel = 0.0  # when the last collective ends
    running: dict[tuple, tuple[float, float]] = {}  # collective -> (start, end)
    exposed: dict[str, np.ndarray] = {}
    total: dict[str, float] = {}
    for op in ops:
        if op.kind == "compute":
            d = compute.get(op.key)
            if d is not None:
                t = t + d
                busy = busy + d
        elif op.kind == "start":
            seconds = float(comm.get(op.key, 0.0))
            if seconds > 0.0:
                begin = max(float(t.max()), channel)
                channel = begin + seconds
                running[op.collective] = (begin, channel)
                total[op.name] = total.get(op.name, 0.0) + seconds
        elif op.kind == "wait":
            if op.collective not in running:
                if comm.get(op.key, 0.0) > 0.0:
                    raise ValueError(f"wait before start: {op}")
                continue
            begin, end = running.pop(op.collective)
            during = np.maximum(0.0, end - np.maximum(t, begin))  # waited while the transfer ran
            exposed[op.name] = exposed.get(op.name, np.zeros(ranks)) + during
            t = np.maximum(t, end)
        else:
            raise ValueError(f"unknown op kind {op.kind!r}")
    if running:
        raise ValueError(f"collectives started and never waited for: {sorted(running)[:3]}")
    return ScheduleTiming(t, busy, exposed, total)
