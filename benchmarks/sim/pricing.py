"""The schedule model: a micro-batch's plans priced on the engine's schedule (per rank and layer the
non-attention work, the server kernels and the all-to-all phases of the traffic ledger, timed by the list
scheduler of :mod:`benchmarks.sim.schedule`), and a step's systems averaged into :class:`Result`."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hf_distca.config import DistCAConfig
from hf_distca.data.baselines import LAYOUTS
from hf_distca.data.nano import nano_tokens_per_rank, split_documents, whole_tokens_per_rank
from hf_distca.planning.links import LAYER_FORWARD_SHARE
from hf_distca.planning.ping_pong import part_plans
from hf_distca.planning.relay import relay_kv_bytes
from hf_distca.planning.traffic import (
    INTER,
    PHASES,
    forward_phases,
    link_classes,
    phase_matrices,
    plan_matrices,
    relays,
)
from hf_distca.planning.window import kv_start

from . import schedule as schedule_ops
from .costs import PEAK_TFLOPS, ModelShape, Setting
from .systems import SCHEDULES, SYSTEM_SPECS, System, plan_layout


@dataclass
class MicroBatch:
    """One micro-batch of one system: per-rank seconds and bytes, and its schedule's timing."""

    linear: np.ndarray
    attention: np.ndarray
    """Per rank, seconds of core attention over all layers."""
    comm: float
    """Seconds of all-to-all collectives over all layers (exposed or not)."""
    bytes_sent: np.ndarray
    """Per rank, bytes sent over all layers and phases."""
    inter_node_bytes: float = 0.0
    """Bytes sent between nodes, all ranks, layers and phases."""
    kv_fanout: int = 0
    """Most servers that read part of one document's KV prefix from one holder."""
    step_s: float = 0.0
    """The schedule's time (max over ranks); systems outside DistCA's engine: the slowest rank's work."""
    synced_s: float = 0.0
    """The same schedule with every collective taking no time (it still synchronises the ranks):
    ``step_s - synced_s`` is the exposed communication."""
    exposed: dict[str, float] = field(default_factory=dict)
    """Phase -> seconds the last rank to finish waited on that phase's transfers."""
    plan_s: float = 0.0
    """CPU seconds of planning on this machine (every plan of the micro-batch)."""


def kv_fanout(plan) -> int:
    """Most servers reading part of one document's KV prefix from the same holder (the holder sends it
    to each of them in every layer)."""
    readers: dict[tuple[int, int], int] = {}
    for server, per_doc in enumerate(plan.kv_ranges):
        for doc, ranges in per_doc.items():
            holders = {h for lo, hi in ranges for h, _, _ in plan.index.segments(doc, lo, hi)}
            for holder in holders - {server}:
                readers[doc, holder] = readers.get((doc, holder), 0) + 1
    return max(readers.values(), default=0)


def traffic(plan, q_row_bytes: int, kv_row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(Q, KV): bytes of query rows / key rows (the plan's key ranges: KV prefixes without a sliding
    window) that rank h (row) holds for server s (column); the traffic ledger's (hf_distca.planning.traffic)."""
    return plan_matrices(plan, q_row_bytes, kv_row_bytes)


def phases(q: np.ndarray, kv: np.ndarray, recompute: str) -> list[np.ndarray]:
    """The all-to-all phases of one layer as the ledger lists them (hf_distca.planning.traffic: forward
    dispatch and return, backward dispatch and return); plain recompute runs the forward's phases again."""
    per_phase = phase_matrices(q, kv)
    forward = [m for m, f in zip(per_phase, forward_phases(), strict=True) if f]
    backward = [m for m, f in zip(per_phase, forward_phases(), strict=True) if not f]
    return forward + (forward if recompute == "full" else []) + backward


def simulate_micro_batch(
    system: System, lengths: Sequence[int], s: Setting, tolerance: float | None = None
) -> MicroBatch:
    """One micro-batch of ``system``; ``tolerance``: the planner's (default DistCAConfig's)."""
    if system.schedule == "layers":  # nano-batches of whole documents, each laid out and planned
        split = split_documents(lengths, system.nanos)  # as the data path (hf_distca.data.nano)
        if split is not None:
            groups = [[int(lengths[i]) for i in g] for g in split]
            plans, plan_s = [], 0.0
            for group, tokens_per_rank in zip(groups, nano_tokens_per_rank(groups, s.world), strict=True):
                _, plan, seconds = plan_layout(system, group, s, tokens_per_rank, tolerance)
                plans.append(plan)
                plan_s += seconds
            mb = price_plans(plans, s, "layers", kv_relay=system.kv_relay)
            mb.plan_s = plan_s
            return mb
        system = dataclasses.replace(system, schedule="serial")  # too few documents: the engine runs it whole
    # the data path's rule: the fewest tokens per rank that hold it, or the budget (hf-default, --pad-to-budget)
    whole = whole_tokens_per_rank(
        lengths, s.world, s.tokens_per_rank, s.pad_to_budget, LAYOUTS[system.layout]
    )
    pieces, plan, plan_s = plan_layout(system, lengths, s, whole, tolerance)
    if plan is None:  # every piece its own sequence, ranks meet only at the gradient reduction
        layers = s.model.layers
        linear = np.array([s.linear.seconds(sum(p.length for p in r), layers) for r in pieces])
        attention = np.array([sum(_task_seconds(s, p.length, p.length) for p in r) for r in pieces]) * layers
        step = float((linear + attention).max())
        return MicroBatch(linear, attention, 0.0, np.zeros(s.world), step_s=step, synced_s=step)
    mb = price_plans([plan], s, system.schedule, kv_relay=system.kv_relay)
    mb.plan_s = plan_s
    return mb


def _task_seconds(s: Setting, q_len: int, kv_len: int) -> float:
    """Seconds of one layer's core attention of a task, forward and backward (twice forward under plain
    recompute)."""
    fwd, fwd_bwd = s.kernels.task_seconds(q_len, kv_len)
    return fwd_bwd + (fwd if s.recompute == "full" else 0.0)


def pre_share(model: ModelShape) -> float:
    """Share of a layer's non-attention work before core attention (norm, QKV projections, RoPE): its
    matmul weights over the layer's (QKV against o_proj and the MLP)."""
    q, kv = model.heads * model.head_dim, model.kv_heads * model.head_dim
    before = model.hidden * (q + 2 * kv)
    return before / (before + model.hidden * q + 3 * model.hidden * model.intermediate)


FORWARD_SHARE = LAYER_FORWARD_SHARE
"""Forward's share of a layer's non-attention work under activation checkpointing (forward, recompute,
backward at about 1 : 1 : 2 of the matmul FLOPs)."""


def price_plan(plan, s: Setting, schedule: str = "serial") -> MicroBatch:
    """One micro-batch run through DistCA's engine under ``plan`` (of the layout's pieces, whatever the
    planner's config) with ``schedule`` ('serial' or 'attention')."""
    return price_plans([plan], s, schedule)


def price_plans(
    plans: Sequence, s: Setting, schedule: str = "serial", split: str | None = None, kv_relay: bool = False
) -> MicroBatch:
    """A micro-batch run through DistCA's engine: ``plans`` one per nano-batch (several only for
    'layers'), timed on their schedule (:mod:`benchmarks.sim.schedule`): per rank and layer the
    non-attention work before attention (``pre_share``) and after it, the server's kernels per part, and
    per part and phase an all-to-all lasting as long as its slowest rank (:meth:`Links.phase_seconds`
    of the traffic ledger's bytes). ``split``: the attention-level nano-batch split (default
    DistCAConfig's). ``kv_relay``: KV through the per-node relay, as ``DistCAConfig(kv_relay=True)``."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule != "layers" and len(plans) != 1:
        raise ValueError(f"{len(plans)} plans for the {schedule!r} schedule")
    layers, world = s.model.layers, s.world
    config = DistCAConfig()
    share = pre_share(s.model)
    compute: dict[tuple, np.ndarray] = {}
    comm: dict[tuple, float] = {}
    linear, attention, sent = np.zeros(world), np.zeros(world), np.zeros(world)
    inter, fanout, nparts = 0.0, 0, 1
    ranks = np.arange(world)
    across = link_classes(ranks[:, None], ranks[None, :], s.links.gpus_per_node) == INTER
    for n, plan in enumerate(plans):
        tokens = np.zeros(world)
        for holding in plan.index.holdings.values():
            for h in holding:
                tokens[h.rank] += h.doc_end - h.doc_start
        per_layer = tokens * s.linear.per_token_layer
        linear += np.array([s.linear.seconds(int(x), layers) for x in tokens])
        compute[("pre", "fwd", n, 0)] = FORWARD_SHARE * share * per_layer
        compute[("post", "fwd", n, 0)] = FORWARD_SHARE * (1 - share) * per_layer
        recomputed = FORWARD_SHARE * (1 - share if s.recompute == "full" else 1.0)  # pre's recompute apart
        compute[("pre_recompute", "bwd", n, 0)] = FORWARD_SHARE * share * per_layer
        compute[("post_bwd", "bwd", n, 0)] = (recomputed + 2 * FORWARD_SHARE * (1 - share)) * per_layer
        compute[("pre_bwd", "bwd", n, 0)] = 2 * FORWARD_SHARE * share * per_layer
        compute[("head", "fwd", n, 0)] = tokens * s.linear.per_token_fixed
        parts = [plan]
        if schedule == "attention" and any(plan.bytes_sent) and world > 1:  # as engine_runner
            parts = part_plans(plan, config.shard_tokens, split or config.ping_pong_split)
        nparts = len(parts)
        for j, part in enumerate(parts):
            fwd, fwd_bwd = np.zeros(world), np.zeros(world)
            for server, tasks in enumerate(part.tasks):
                for t in tasks:
                    f, fb = s.kernels.task_seconds(t.q_len, t.q_end - kv_start(t.q_start, part.window))
                    fwd[server] += f
                    fwd_bwd[server] += fb
            compute[("kernel", "fwd", n, j)] = fwd
            compute[("kernel", "bwd", n, j)] = fwd_bwd - fwd
            attention += layers * (fwd_bwd + (fwd if s.recompute == "full" else 0.0))
            q, kv = traffic(part, s.model.q_row_bytes, s.model.kv_row_bytes)
            stages = [(q, kv)]
            if relays(kv_relay, s.links.gpus_per_node, world):  # as the engine and planner decide it
                first, second = relay_kv_bytes(part, s.model.kv_row_bytes, s.links.gpus_per_node)
                stages = [(q, first), (np.zeros_like(q), second)]
            for q_stage, kv_stage in stages:  # stages run one after the other
                for phase, m in zip(PHASES, phase_matrices(q_stage, kv_stage), strict=True):
                    key = (phase, phase[:3], n, j)
                    comm[key] = comm.get(key, 0.0) + s.links.phase_seconds(m)
            layer_phases = [m for q_stage, kv_stage in stages for m in phases(q_stage, kv_stage, s.recompute)]
            sent += layers * sum(m.sum(1) - np.diag(m) for m in layer_phases)
            inter += layers * sum(float(m[across].sum()) for m in layer_phases)
        fanout = max(fanout, kv_fanout(plan))
    if schedule == "layers":
        ops = schedule_ops.layer_ping_pong(layers, len(plans))
    else:
        ops = schedule_ops.serial(layers, nparts, s.recompute)
    timing = schedule_ops.run_schedule(ops, compute, comm, world)
    synced = schedule_ops.run_schedule(ops, compute, {k: 1e-12 for k, v in comm.items() if v > 0}, world)
    last = int(timing.finish.argmax())
    exposed = {phase: float(x[last]) for phase, x in timing.exposed.items()}
    return MicroBatch(
        linear, attention, sum(timing.comm.values()), sent, inter, fanout, timing.step, synced.step, exposed
    )


@dataclass
class Result:
    """One system on one setting, averaged over the simulated steps."""

    system: str
    step_s: float
    busy_max_s: float
    busy_mean_s: float
    imbalance: float
    """max / mean over ranks of busy time (linear + attention), mean over steps."""
    exposed_comm_s: float
    """Step time less the same schedule with collectives that take no time (they still synchronise)."""
    sent_gib_max: float
    """Most GiB one rank sends per step."""
    tokens_per_s: float
    mfu: float
    ideal_step_s: float
    sent_max_over_mean: float = 0.0
    """Most bytes one rank sends over the mean over ranks, per step (mean over steps)."""
    inter_node_share: float = 0.0
    """Fraction of the bytes sent that cross nodes."""
    kv_fanout: int = 0
    """Most servers reading one document's KV prefix from one holder, any micro-batch of any step."""
    busy_s: list[float] = field(default_factory=list)
    """Per rank busy seconds, mean over steps."""
    synced_s: float = 0.0
    """Step time with collectives that take no time (mean over steps)."""
    exposed_by_phase: dict[str, float] = field(default_factory=dict)
    """Phase -> seconds the last rank waited on its transfers per step (mean over steps)."""
    plan_s: float = 0.0
    """CPU seconds of planning one step on the machine that ran the simulation (mean over steps)."""
    comm_s: float = 0.0
    """Seconds of all-to-all collectives per step, exposed or not (mean over steps)."""

    @property
    def gap_to_ideal(self) -> float:
        return self.step_s / self.ideal_step_s - 1.0

    def left(self) -> tuple[float, float, float]:
        """Seconds between this step and the ideal, in three parts that add up to it: exposed
        communication (step - synced), residual imbalance (synced - mean busy: ranks waiting for each
        other at the collectives and at the end) and kernels and padding (mean busy - ideal: more work
        than the exact computation's mean: short shards at lower rates, padding tokens)."""
        return (
            self.step_s - self.synced_s,
            self.synced_s - self.busy_mean_s,
            self.busy_mean_s - self.ideal_step_s,
        )


def ideal_work(step: Sequence[Sequence[int]], s: Setting) -> float:
    """Seconds of the exact computation of a step's real tokens on one GPU: every token's non-attention
    work and every document's core attention whole, in one kernel (no padding: the layouts pad each
    micro-batch, or nano-batch, to its tokens per rank, and that padding is work the ideal does not do)."""
    lengths = [int(n) for mb in step for n in mb]
    attention = sum(_task_seconds(s, n, n) for n in lengths if n) * s.model.layers
    return s.linear.seconds(sum(lengths), s.model.layers) + attention


def simulate(
    systems: Sequence[str], steps: list[list[list[int]]], s: Setting, tolerance: float | None = None
) -> dict[str, Result]:
    """Every system on the same steps (steps -> micro-batches -> document lengths); ``tolerance``
    replaces the planner tolerance of the distca systems. A step: the sum over its micro-batches of
    their schedule's time."""
    per_step: dict[str, list[tuple]] = {name: [] for name in systems}
    ideal = []
    for step in steps:
        for name in systems:
            system = SYSTEM_SPECS[name]
            mbs = [simulate_micro_batch(system, lengths, s, tolerance) for lengths in step]
            busy = sum(mb.linear + mb.attention for mb in mbs)
            if name in per_step:
                sent = sum(mb.bytes_sent for mb in mbs)
                inter = sum(mb.inter_node_bytes for mb in mbs)
                exposed: dict[str, float] = {}
                for mb in mbs:
                    for phase, x in mb.exposed.items():
                        exposed[phase] = exposed.get(phase, 0.0) + x
                per_step[name].append((
                    sum(mb.step_s for mb in mbs), busy, sum(mb.step_s - mb.synced_s for mb in mbs), sent, inter,
                    max(mb.kv_fanout for mb in mbs), sum(mb.synced_s for mb in mbs), exposed,
                    sum(mb.plan_s for mb in mbs), sum(mb.comm for mb in mbs),
                ))  # fmt: skip
        ideal.append(ideal_work(step, s) / s.world)
    tokens = [sum(n for mb in step for n in mb) for step in steps]
    flops = [s.model.model_flops([n for mb in step for n in mb]) for step in steps]
    out = {}
    for name, rows in per_step.items():
        times = [r[0] for r in rows]
        busy = np.mean([r[1] for r in rows], axis=0)
        phases_seen = sorted({p for r in rows for p in r[7]}, key=PHASES.index)
        out[name] = Result(
            system=name,
            step_s=statistics.fmean(times),
            busy_max_s=float(busy.max()),
            busy_mean_s=float(busy.mean()),
            imbalance=statistics.fmean(float(r[1].max() / r[1].mean()) for r in rows),
            exposed_comm_s=statistics.fmean(r[2] for r in rows),
            sent_gib_max=statistics.fmean(float(r[3].max()) for r in rows) / 2**30,
            sent_max_over_mean=statistics.fmean(
                float(r[3].max() / r[3].mean()) if r[3].any() else 0.0 for r in rows
            ),
            inter_node_share=sum(r[4] for r in rows) / max(sum(float(r[3].sum()) for r in rows), 1.0),
            kv_fanout=max(r[5] for r in rows),
            tokens_per_s=sum(tokens) / sum(times),
            mfu=sum(flops) / (sum(times) * s.world * PEAK_TFLOPS * 1e12),
            ideal_step_s=statistics.fmean(ideal),
            busy_s=[float(x) for x in busy],
            synced_s=statistics.fmean(r[6] for r in rows),
            exposed_by_phase={p: statistics.fmean(r[7].get(p, 0.0) for r in rows) for p in phases_seen},
            plan_s=statistics.fmean(r[8] for r in rows),
            comm_s=statistics.fmean(r[9] for r in rows),
        )
    return out


def ideal_gain_share(results: dict[str, Result], system: str = "distca") -> float | None:
    """(speedup - 1) / (ideal speedup - 1) of ``system`` against exact-unbalanced (None if no gain possible)."""
    if "exact-unbalanced" not in results or system not in results:
        return None
    base = results["exact-unbalanced"].step_s
    ideal = base / results[system].ideal_step_s
    if ideal < 1.02:  # under 2% to gain: the share says nothing
        return None
    return (base / results[system].step_s - 1.0) / (ideal - 1.0)
