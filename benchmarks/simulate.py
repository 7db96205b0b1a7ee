"""Simulated step times of DistCA and its baselines on 2-512 GPUs, from measured kernel and link tables.

Replays the global batches a recipe run would train (benchmarks/workloads.py: same seed, same documents
for every system) on N GPUs (``--gpus-per-node`` per node, NVLink inside a node, a stated inter-node
bandwidth per GPU) and prices every rank's work:

- systems (how each is run through recipes/finetune_long_docs.py is in benchmarks/suite.py):
  ``hf-default`` (hf_distca.data.baselines.hf_default_layout, attention local to each piece: documents
  longer than a rank's budget become independent chunks, the math differs), ``exact-unbalanced`` (the
  token-only rebatcher layout, hf_distca.data.layout_pieces, DistCA's engine with balancing off,
  ``DistCAConfig(max_planner_moves=0)``: each rank computes its own pieces, fetching the KV prefix of
  pieces cut over ranks), ``balanced`` (WLB-LLM-style balanced packing, hf_distca.data.layout_balanced,
  run like exact-unbalanced: DistCA's layout without its planner), ``distca`` (DistCA's default: the
  balanced layout and the real planner, ``hf_distca.plan_core_attention``, ``--tolerance``, default
  0.1, balancing compute only), ``distca-comm`` (the same planner pricing communication on the simulated
  links: ``DistCAConfig(link_gib_per_s=--inter-node-gibps, ranks_per_node=--gpus-per-node,
  intra_node_gib_per_s=the intra-node all-to-all at 256 MiB per rank)``, see :func:`planner_config`,
  and the layout DistCACallback builds from that config: documents cut inside one node) and
  ``distca-pingpong`` (a projection: distca with each micro-batch's communication hidden under its
  compute as far as that lasts, which ping-pong nano-batches would do; hf_distca does not implement it).
- core attention: every CA-task (queries [a, b) of a document over keys [0, b)) costs its causal
  (query, key) pairs over the measured rate of its shape, per layer: forward + backward (the
  ``remat`` recompute mode, rematerialization-aware checkpointing: attention is not run again) or
  forward twice + backward (``full``: plain activation recompute). Kernel table: the figures of
  benchmarks/results/kernels_h200.md (whole documents of 512-32K tokens; a task's rate is taken as
  the measured rate of whole documents as long as its query shard, so short shards over long prefixes
  are priced conservatively; the forward alone from the measured forward times), or ``--kernel-table``,
  a JSON table written by ``python -m hf_distca.calibrate`` (q_len x kv_len -> seconds of a task,
  forward+backward; the forward alone is then taken as 1/3.5 of it, the FLOP ratio).
- everything else (projections, MLP, norms, LM head and loss, optimizer), linear in tokens:
  ``layers x per_layer + fixed`` seconds per token, fitted to this project's H200 measurements
  (the project design notes, DESIGN.md "Measured": a 4-layer Llama-3-8B-shaped stack took 1.33 / 1.52 / 2.23 / 3.18 s
  for 64K tokens as 32 x 2K / 8 x 8K / 2 x 32K / 1 x 64K documents with gradient checkpointing; minus
  the kernel table's attention (forward twice + backward) that leaves ~1.26 s for every mix; and an
  8-layer run's non-attention part was ~2.3 s per 64K tokens): ~3.97 us per token per layer plus
  ~3.4 us per token, with activation checkpointing (overridable).
- communication (DistCA's engine: all-to-all-v per layer; bytes per the traffic ledger,
  hf_distca.planning.traffic: forward Q +
  KV out and outputs back, backward Q, output, output gradient, KV out and dQ, dK, dV back; plain
  recompute adds another forward): each all-to-all phase lasts as long as its slowest rank, whose
  NVLink traffic (per-rank volume -> GiB/s interpolated in log-log from the measured 2-GPU NCCL
  all-to-all, ~140 / 260 / 307 GiB/s at 16 MiB / 256 MiB / 1 GiB, extrapolated below 16 MiB along the
  first segment) and inter-node traffic (flat ``--inter-node-gibps``) proceed at the same time. No
  communication is overlapped with compute (ping-pong is not implemented): all of it is exposed.
  ``--intra-link host`` prices the 2-GPU link as measured with ``NCCL_P2P_DISABLE=1`` (~22 GiB/s).
- step time: systems with a collective per layer (everything run through DistCA's engine) wait for the
  slowest rank at every layer: sum over micro-batches of (max linear + layers x max attention + exposed
  communication); ``hf-default`` only synchronises at the gradient reduction: max over ranks of its
  summed work. Gradient all-reduce is the same for every system and left out.
- ideal bound: perfect balance and no exposed communication: the exact computation's total work
  (exact-unbalanced's busy time summed over ranks) divided by the number of GPUs.
- MFU: model FLOPs of the step (6 x matmul parameters per real token, plus causal attention 3 x 4 x
  heads x head_dim per (query, key) pair per layer, exact for every system) over step time x GPUs x
  989 TFLOP/s. tokens/s counts real (not padding) tokens.

    python benchmarks/simulate.py --workload pretrain=PATH/doclens_pretrain.json \\
        --workload prolong=PATH/doclens_prolong.json --workload long-mix --gpus 2 8 64 512 \\
        --tokens-per-rank 32768 65536 --out benchmarks/results/DATE-simulated.md

Writes the markdown file and a PNG next to it (same name, ``.png``). These are simulated figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import shlex
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hf_distca.config import DistCAConfig
from hf_distca.data.baselines import LAYOUTS
from hf_distca.planning import MeasuredCost, plan_core_attention
from hf_distca.planning.cost import causal_pairs
from hf_distca.planning.links import attention_flops_per_pair
from hf_distca.planning.traffic import (
    INTER,
    INTRA,
    forward_phases,
    link_classes,
    phase_matrices,
    plan_matrices,
)
from hf_distca.planning.window import kv_start

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import documents_for, draw_lengths, global_batches, load_sample  # noqa: E402

PEAK_TFLOPS = 989.0
"""Dense bf16 peak of one H200 (SXM), TFLOP/s: the MFU denominator."""

KERNELS_H200 = (
    # doc length, forward ms, forward+backward ms for 65536 tokens of such documents; torch_varlen,
    # bf16, 32 query / 8 KV heads x 128, causal; benchmarks/results/kernels_h200.md (1 x H200)
    (512, 1.957, 7.011),
    (2048, 3.800, 15.106),
    (8192, 13.303, 50.439),
    (32768, 50.926, 189.271),
)
KERNELS_H200_SOURCE = "benchmarks/results/kernels_h200.md (torch_varlen, bf16, 32/8 heads x 128, 1 x H200)"
NVLINK_ALL_TO_ALL = ((16 * 2**20, 140.0), (256 * 2**20, 260.0), (2**30, 307.0))
"""(bytes per rank, GiB/s): NCCL all_to_all_single between 2 H200s over NVLink (DESIGN.md, Measured)."""
HOST_STAGED_GIBPS = 22.0
"""GiB/s of the same all-to-all with NCCL_P2P_DISABLE=1 (21-23 from 16 MiB to 1 GiB; DESIGN.md)."""
STRAGGLER_4_LAYERS = {2048: 1.33, 8192: 1.52, 32768: 2.23, 65536: 3.18}
"""Document length -> seconds of forward+backward of 65536 tokens of such documents through a 4-layer
Llama-3-8B-shaped stack (128K vocabulary, gradient checkpointing, varlen attention) on 1 H200 (DESIGN.md)."""
NON_ATTENTION_8_LAYERS = 2.3
"""Seconds of the non-attention part of a step of 65536 tokens per rank, 8 layers (DESIGN.md, Measured)."""
PLANNER_INTRA_BYTES = 256 * 2**20
"""Per-rank all-to-all volume at which the comm-aware planner reads the intra-node bandwidth."""
FLOP_RATIO_FWD_BWD = 3.5
"""forward+backward over forward FLOPs of attention (backward ~2.5 forward), the kernels table's convention."""

SYSTEMS = ("hf-default", "exact-unbalanced", "balanced", "distca", "distca-comm", "distca-pingpong")


@dataclass(frozen=True)
class System:
    """How a system lays out and computes a micro-batch."""

    name: str
    layout: str
    """Key of hf_distca.data.baselines.LAYOUTS."""
    disaggregate: bool
    """Through DistCA's engine (exact, a collective per layer) or attention local to each piece."""
    balance: bool
    """Whether the planner moves work (False: ``DistCAConfig(max_planner_moves=0)``, each rank computes
    its own pieces)."""
    overlap: bool = False
    """Communication hidden under compute as far as compute lasts (ping-pong): a projection, not
    implemented in hf_distca; off for every measured system."""
    comm_aware: bool = False
    """The planner prices moves against the simulated links (``DistCAConfig(link_gib_per_s=inter-node,
    intra_node_gib_per_s=..., ranks_per_node=GPUs per node)``, see :func:`planner_config`)."""


SYSTEM_SPECS = {
    "hf-default": System("hf-default", "hf-default", False, False),
    "exact-unbalanced": System("exact-unbalanced", "tokens", True, False),
    "balanced": System("balanced", "balanced", True, False),
    "distca": System("distca", "distca", True, True),
    "distca-comm": System("distca-comm", "distca", True, True, comm_aware=True),
    "distca-pingpong": System("distca-pingpong", "distca", True, True, overlap=True),
}


@dataclass(frozen=True)
class ModelShape:
    """A Llama-style decoder (default: Llama-3-8B-shaped)."""

    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    vocab: int = 128256
    bytes_per_element: int = 2
    """2 for bf16: the size of q/k/v rows that DistCA's engine moves."""

    @property
    def q_row_bytes(self) -> int:
        return self.heads * self.head_dim * self.bytes_per_element

    @property
    def kv_row_bytes(self) -> int:
        return 2 * self.kv_heads * self.head_dim * self.bytes_per_element

    @property
    def matmul_params(self) -> int:
        """Weights multiplied per token: attention projections, MLP, LM head (not the embedding lookup)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.intermediate
        return self.layers * per_layer + self.hidden * self.vocab

    def model_flops(self, doc_lengths: Sequence[int]) -> float:
        """Forward+backward model FLOPs of these documents (causal attention counted exactly)."""
        pairs = sum(causal_pairs(0, n) for n in doc_lengths)
        return (
            6.0 * self.matmul_params * sum(doc_lengths)
            + 12.0 * self.heads * self.head_dim * self.layers * pairs
        )


class KernelTable:
    """Seconds of one layer's core attention of a CA-task, forward and forward+backward."""

    def __init__(self, forward: MeasuredCost, forward_backward: MeasuredCost, source: str):
        self.forward = forward
        self.forward_backward = forward_backward
        self.source = source

    @classmethod
    def from_kernel_rows(cls, rows=KERNELS_H200, source: str = KERNELS_H200_SOURCE) -> KernelTable:
        """From whole-document measurements (doc length, forward ms, forward+backward ms per 65536 tokens)."""
        lens = [int(r[0]) for r in rows]

        def table(column: int) -> MeasuredCost:
            rate = {
                n: (65536 // n) * causal_pairs(0, n) / (ms / 1e3)
                for n, *times in rows
                for ms in [times[column]]
            }
            seconds = [[_pairs(q, kv) / rate[q] if q <= kv else math.nan for kv in lens] for q in lens]
            return MeasuredCost(lens, lens, seconds)

        return cls(table(0), table(1), source)

    @classmethod
    def from_json(cls, path: str) -> KernelTable:
        """A table written by ``python -m hf_distca.calibrate`` (format ``hf_distca.cost_table/1``)."""
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or not str(data.get("format", "")).startswith("hf_distca.cost_table/"):
            raise ValueError(f"{path}: not a cost table of python -m hf_distca.calibrate (no 'format' field)")
        seconds = np.array([[math.nan if x is None else float(x) for x in row] for row in data["seconds"]])
        timed = data.get("measured", {}).get("timed", "forward+backward")
        fwd_bwd = seconds if timed == "forward+backward" else seconds * FLOP_RATIO_FWD_BWD
        fwd = fwd_bwd / FLOP_RATIO_FWD_BWD
        measured = data.get("measured", {})
        source = f"{path} ({measured.get('device', '?')}, {measured.get('backend', '?')}, timed {timed})"
        return cls(
            MeasuredCost(data["q_lens"], data["kv_lens"], fwd),
            MeasuredCost(data["q_lens"], data["kv_lens"], fwd_bwd),
            source,
        )

    @functools.lru_cache(maxsize=1 << 16)  # noqa: B019 - one table per run, shapes repeat
    def task_seconds(self, q_len: int, kv_len: int) -> tuple[float, float]:
        """(forward, forward+backward) seconds of q_len queries at the end of a kv_len-token prefix."""
        a, b = kv_len - q_len, kv_len
        return self.forward.task_cost(a, b), self.forward_backward.task_cost(a, b)


def _pairs(q_len: int, kv_len: int) -> int:
    return causal_pairs(kv_len - q_len, kv_len)


@dataclass(frozen=True)
class Links:
    """Bandwidth of an all-to-all phase per GPU: NVLink inside a node, a flat figure between nodes."""

    gpus_per_node: int = 8
    intra: tuple[tuple[float, float], ...] = NVLINK_ALL_TO_ALL
    """(bytes per rank, GiB/s) points of the intra-node all-to-all."""
    inter_gibps: float = 46.6
    """GiB/s per GPU between nodes (46.6: one 400 Gb/s NIC per GPU)."""

    def intra_seconds(self, nbytes: np.ndarray) -> np.ndarray:
        """Seconds to move ``nbytes`` (per rank) inside a node; log-log interpolation of the table."""
        nbytes = np.asarray(nbytes, dtype=np.float64)
        xs = np.log([s for s, _ in self.intra])
        ys = np.log([g * 2**30 for _, g in self.intra])
        x = np.log(np.maximum(nbytes, 1.0))
        y = np.interp(x, xs, ys)
        if len(xs) > 1:  # below the table: continue the first segment
            slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
            y = np.where(x < xs[0], ys[0] + (x - xs[0]) * slope, y)
        return np.where(nbytes > 0, nbytes / np.exp(y), 0.0)

    def intra_gibps_at(self, nbytes: float) -> float:
        """GiB/s of the intra-node all-to-all at ``nbytes`` per rank."""
        return float(nbytes / self.intra_seconds(np.array([nbytes]))[0]) / 2**30

    def phase_seconds(self, matrix: np.ndarray) -> float:
        """Duration of one all-to-all: ``matrix[src, dst]`` bytes; the slowest rank, its NVLink and
        inter-node traffic moving at the same time, sending and receiving at the same time."""
        world = matrix.shape[0]
        ranks = np.arange(world)
        same = link_classes(ranks[:, None], ranks[None, :], self.gpus_per_node) == INTRA
        off = matrix * (1 - np.eye(world))
        intra = np.maximum((off * same).sum(1), (off * same).sum(0))
        inter = np.maximum((off * ~same).sum(1), (off * ~same).sum(0))
        seconds = np.maximum(self.intra_seconds(intra), inter / (self.inter_gibps * 2**30))
        return float(seconds.max()) if world else 0.0


@dataclass(frozen=True)
class LinearCost:
    """Seconds per token of everything but core attention (with activation checkpointing)."""

    per_token_layer: float
    per_token_fixed: float
    source: str = "given"

    @classmethod
    def from_measurements(cls) -> LinearCost:
        """Fit to DESIGN.md's measurements: the 4-layer stack's step minus its attention (forward twice
        plus backward: gradient checkpointing recomputed attention), priced with the kernel those
        measurements ran (kernels_h200.md, FlashAttention-2 varlen, whatever table prices the
        simulated attention), then the 8-layer figure."""
        kernels = KernelTable.from_kernel_rows()
        rest = []
        for length, seconds in STRAGGLER_4_LAYERS.items():
            fwd, fwd_bwd = kernels.task_seconds(length, length)
            rest.append(seconds - 4 * (65536 // length) * (fwd + fwd_bwd))
        four = statistics.fmean(rest)  # seconds of 65536 tokens, 4 layers
        per_layer = (NON_ATTENTION_8_LAYERS - four) / 4
        return cls(
            per_layer / 65536, (four - 4 * per_layer) / 65536, "fitted to DESIGN.md's H200 measurements"
        )

    def seconds(self, tokens: int, layers: int) -> float:
        return tokens * (layers * self.per_token_layer + self.per_token_fixed)


@dataclass(frozen=True)
class Setting:
    """Everything a simulated run depends on besides the system and the batches."""

    world: int
    tokens_per_rank: int
    model: ModelShape
    kernels: KernelTable
    links: Links
    linear: LinearCost
    recompute: str = "remat"
    """'remat': attention forward once (rematerialization-aware checkpointing); 'full': recomputed."""
    grad_accum: int = 1


@dataclass
class MicroBatch:
    """One micro-batch of one system: per-rank seconds and bytes."""

    linear: np.ndarray
    attention: np.ndarray
    """Per rank, seconds of core attention over all layers."""
    comm: float
    """Seconds of all-to-all over all layers (all exposed)."""
    bytes_sent: np.ndarray
    """Per rank, bytes sent over all layers and phases."""
    inter_node_bytes: float = 0.0
    """Bytes sent between nodes, all ranks, layers and phases."""
    kv_fanout: int = 0
    """Most servers that read part of one document's KV prefix from one holder."""


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


def planner_config(system: System, s: Setting, tolerance: float | None = None) -> DistCAConfig:
    """The DistCAConfig a system's planner runs with: ``tolerance`` (default DistCAConfig's), no move
    without balancing, and for ``comm_aware`` systems the simulated links: ``link_gib_per_s`` the
    inter-node bandwidth, ``ranks_per_node`` the GPUs per node, ``intra_node_gib_per_s`` the intra-node
    all-to-all's bandwidth at 256 MiB per rank (the planner takes one flat figure per link class)."""
    fields = {
        "tolerance": DistCAConfig().tolerance if tolerance is None else tolerance,
        "max_planner_moves": DistCAConfig().max_planner_moves if system.balance else 0,
    }
    if system.comm_aware:
        fields.update(
            link_gib_per_s=s.links.inter_gibps,
            ranks_per_node=s.links.gpus_per_node,
            intra_node_gib_per_s=s.links.intra_gibps_at(PLANNER_INTRA_BYTES),
        )
    return DistCAConfig(**fields)


def simulate_micro_batch(
    system: System, lengths: Sequence[int], s: Setting, tolerance: float | None = None
) -> MicroBatch:
    """One micro-batch of ``system``; ``tolerance``: the planner's (default DistCAConfig's)."""
    config = planner_config(system, s, tolerance)
    layout = LAYOUTS[system.layout]
    if system.layout == "distca":  # as DistCACallback's default: cut documents inside a node when it is known
        layout = functools.partial(layout, ranks_per_node=config.ranks_per_node)
    pieces = layout(lengths, world_size=s.world, tokens_per_rank=s.tokens_per_rank)
    forwards_again = 1 if s.recompute == "full" else 0  # plain recompute runs the forward a second time

    def seconds(q_len: int, kv_len: int) -> float:
        fwd, fwd_bwd = s.kernels.task_seconds(q_len, kv_len)
        return fwd_bwd + forwards_again * fwd

    layers = s.model.layers
    linear = np.array([s.linear.seconds(sum(p.length for p in r), layers) for r in pieces])
    if not system.disaggregate:  # every piece its own sequence
        attention = np.array([sum(seconds(p.length, p.length) for p in r) for r in pieces]) * layers
        return MicroBatch(linear, attention, 0.0, np.zeros(s.world))
    plan = plan_core_attention(
        pieces,
        q_row_bytes=s.model.q_row_bytes,
        kv_row_bytes=s.model.kv_row_bytes,
        config=config,
        flops_per_pair=attention_flops_per_pair(s.model.heads, s.model.head_dim),
    )
    return price_plan(plan, s)


def price_plan(plan, s: Setting) -> MicroBatch:
    """One micro-batch run through DistCA's engine under ``plan`` (of the layout's pieces, whatever the
    planner's config): per-rank linear and core-attention seconds, and the all-to-all phases."""
    forwards_again = 1 if s.recompute == "full" else 0

    def seconds(q_len: int, kv_len: int) -> float:
        fwd, fwd_bwd = s.kernels.task_seconds(q_len, kv_len)
        return fwd_bwd + forwards_again * fwd

    layers = s.model.layers
    tokens = np.zeros(plan.world_size)
    for holding in plan.index.holdings.values():
        for h in holding:
            tokens[h.rank] += h.doc_end - h.doc_start
    linear = np.array([s.linear.seconds(int(n), layers) for n in tokens])
    # a task's shape: its queries over the keys it reads (its prefix, or its window's keys)
    attention = (
        np.array(
            [
                sum(seconds(t.q_len, t.q_end - kv_start(t.q_start, plan.window)) for t in tasks)
                for tasks in plan.tasks
            ]
        )
        * layers
    )
    q, kv = traffic(plan, s.model.q_row_bytes, s.model.kv_row_bytes)
    layer_phases = phases(q, kv, s.recompute)
    comm = layers * sum(s.links.phase_seconds(m) for m in layer_phases)
    sent = layers * sum(m.sum(1) - np.diag(m) for m in layer_phases)
    ranks = np.arange(s.world)
    across = link_classes(ranks[:, None], ranks[None, :], s.links.gpus_per_node) == INTER
    inter = layers * sum(float(m[across].sum()) for m in layer_phases)
    return MicroBatch(linear, attention, comm, sent, inter, kv_fanout(plan))


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

    @property
    def gap_to_ideal(self) -> float:
        return self.step_s / self.ideal_step_s - 1.0


def simulate(
    systems: Sequence[str], steps: list[list[list[int]]], s: Setting, tolerance: float | None = None
) -> dict[str, Result]:
    """Every system on the same steps (steps -> micro-batches -> document lengths); ``tolerance``
    replaces the planner tolerance of the distca systems."""
    per_step: dict[str, list[tuple]] = {name: [] for name in systems}
    ideal = []
    for step in steps:
        exact_busy = np.zeros(s.world)
        for name in dict.fromkeys([*systems, "exact-unbalanced"]):
            system = SYSTEM_SPECS[name]
            mbs = [simulate_micro_batch(system, lengths, s, tolerance) for lengths in step]
            busy = sum(mb.linear + mb.attention for mb in mbs)
            compute = [mb.linear.max() + mb.attention.max() for mb in mbs]
            if not system.disaggregate:  # ranks meet only at the gradient reduction
                step_s, exposed = float(busy.max()), 0.0
            elif system.overlap:  # communication runs while the other nano-batch computes
                step_s = sum(max(c, mb.comm) for c, mb in zip(compute, mbs))
                exposed = sum(max(0.0, mb.comm - c) for c, mb in zip(compute, mbs))
            else:  # every layer waits for its all-to-alls
                exposed = sum(mb.comm for mb in mbs)
                step_s = sum(compute) + exposed
            if name == "exact-unbalanced":
                exact_busy = busy
            if name in per_step:
                sent = sum(mb.bytes_sent for mb in mbs)
                inter = sum(mb.inter_node_bytes for mb in mbs)
                per_step[name].append((step_s, busy, exposed, sent, inter, max(mb.kv_fanout for mb in mbs)))
        ideal.append(float(exact_busy.sum()) / s.world)
    tokens = [sum(n for mb in step for n in mb) for step in steps]
    flops = [s.model.model_flops([n for mb in step for n in mb]) for step in steps]
    out = {}
    for name, rows in per_step.items():
        times = [r[0] for r in rows]
        busy = np.mean([r[1] for r in rows], axis=0)
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


# ---------------------------------------------------------------------------------------- the report


@dataclass
class Row:
    workload: str
    tokens_per_rank: int
    world: int
    inter_gibps: float | None
    """None for a single node (the inter-node bandwidth does not matter)."""
    results: dict[str, Result]


def run_grid(args, log=print) -> tuple[list[Row], dict]:
    model = dataclasses.replace(ModelShape(), layers=args.layers)
    kernels = (
        KernelTable.from_json(args.kernel_table) if args.kernel_table else KernelTable.from_kernel_rows()
    )
    if args.linear_us_per_token_layer is not None:
        linear = LinearCost(args.linear_us_per_token_layer * 1e-6, args.linear_us_per_token_fixed * 1e-6)
    else:
        linear = LinearCost.from_measurements()
    intra = ((1.0, HOST_STAGED_GIBPS),) if args.intra_link == "host" else NVLINK_ALL_TO_ALL
    rows = []
    for spec in args.workload:
        name, sample = load_sample(spec, seed=args.seed)
        for tokens_per_rank in args.tokens_per_rank:
            for world in args.gpus:
                tokens_per_step = world * tokens_per_rank * args.grad_accum
                count = args.num_documents or documents_for(sample, args.steps, tokens_per_step)
                lengths = draw_lengths(sample, count, args.seed)
                steps = global_batches(
                    lengths, world_size=world, tokens_per_rank=tokens_per_rank, grad_accum=args.grad_accum,
                    seed=args.seed, steps=args.steps,
                )  # fmt: skip
                bandwidths = args.inter_node_gibps if world > args.gpus_per_node else [None]
                for inter in bandwidths:
                    links = Links(args.gpus_per_node, intra, inter or args.inter_node_gibps[0])
                    setting = Setting(world, tokens_per_rank, model, kernels, links, linear, args.recompute,
                                      args.grad_accum)  # fmt: skip
                    results = simulate(args.systems, steps, setting, args.tolerance)
                    rows.append(Row(name, tokens_per_rank, world, inter, results))
                    log(f"{name} {tokens_per_rank} x {world} GPUs, inter {inter}: "
                        + ", ".join(f"{k} {r.step_s:.2f}s" for k, r in results.items()))  # fmt: skip
    info = {"model": model, "kernels": kernels.source, "linear": linear, "intra": intra}
    return rows, info


def _share(share: float | None) -> str:
    return "n/a (< 2% to gain)" if share is None else f"{share:.0%}"


def _fmt_bw(gibps: float | None) -> str:
    return "-" if gibps is None else f"{gibps:g}"


def write_report(rows: list[Row], info: dict, args, command: str) -> str:
    linear: LinearCost = info["linear"]
    model: ModelShape = info["model"]
    lines = [
        f"# Simulated step times: DistCA and baselines on {', '.join(map(str, args.gpus))} GPUs",
        "",
        "**These are simulated figures, not measurements.** They come from benchmarks/simulate.py, which "
        "prices the real layouts and the real DistCA planner's plans with measured tables; read its "
        "docstring for the model. Generated on a CPU machine "
        f"({platform.machine()}, Python {platform.python_version()}, numpy {np.__version__}) on "
        f"{datetime.date.today().isoformat()}.",
        "",
        f"Command: `{command}`",
        "",
        "Tables used:",
        f"- core attention: {info['kernels']}",
        f"- non-attention work: {linear.per_token_layer * 1e6:.3f} us per token per layer + "
        f"{linear.per_token_fixed * 1e6:.3f} us per token ({linear.source}), {model.layers} layers "
        "(Llama-3-8B-shaped: hidden 4096, 32/8 heads x 128, MLP 14336, vocabulary 128256)",
        "- intra-node all-to-all: "
        + ", ".join(f"{g:g} GiB/s at {s / 2**20:g} MiB" for s, g in info["intra"])
        + (
            " (NCCL_P2P_DISABLE=1 measurement, DESIGN.md)"
            if args.intra_link == "host"
            else " per rank (2 x H200 NVLink NCCL all-to-all, DESIGN.md; assumed for 8 GPUs on NVSwitch)"
        )
        + f"; {args.gpus_per_node} GPUs per node",
        "- inter-node: " + ", ".join(f"{g:g}" for g in args.inter_node_gibps) + " GiB/s per GPU "
        "(23.3 = 200 Gb/s, 46.6 = 400 Gb/s; the 2-GPU NCCL_P2P_DISABLE=1 measurement, ~22 GiB/s, sits at "
        "the low end)",
        f"- recompute: {args.recompute} "
        + (
            "(rematerialization-aware checkpointing: attention runs forward once)"
            if args.recompute == "remat"
            else "(plain activation recompute: attention and its communication run forward twice)"
        ),
        f"- {args.steps} optimizer steps of {args.grad_accum} micro-batch(es) per setting, seed {args.seed}; "
        "every system trains the same documents per step",
        "- no communication is overlapped with compute (ping-pong is not implemented): exposed = all, "
        "except in the distca-pingpong row",
        "- distca-comm's planner: DistCAConfig(link_gib_per_s=the inter-node figure, ranks_per_node="
        f"{args.gpus_per_node}, intra_node_gib_per_s=the intra-node all-to-all at 256 MiB per rank), causal "
        "pairs priced at the default attention_tflops=300 (forward+backward), comm_overlap=0",
        "",
        "Systems: hf-default (each rank packs whole documents in order, attention local to each piece; "
        "documents longer than the budget become independent chunks: **the math differs**), "
        "exact-unbalanced (the token-only rebatcher layout, layout_pieces, DistCA engine with balancing off: "
        "max_planner_moves=0), balanced (WLB-LLM-style balanced packing with per-document context "
        "parallelism, layout_balanced, exact, planner off), distca (DistCA's default: the same balanced "
        f"layout and the planner, tolerance {args.tolerance:g}, balancing compute only), distca-comm (the "
        "same with communication-aware planning: each move priced by the compute time it saves against the "
        "transfer time it adds on the simulated links; its layout cuts documents inside one node), "
        "distca-pingpong (**a projection of a feature hf_distca does not have "
        "yet**: distca's plans with each micro-batch's communication hidden under its compute as far as "
        "the compute lasts, as ping-pong nano-batches would). Ideal: the exact computation perfectly "
        "balanced with no exposed "
        "communication. 'share of ideal gain': (speedup - 1) / (ideal speedup - 1), both against "
        "exact-unbalanced.",
        "",
        "## DistCA against the ideal",
        "",
        "| workload | tokens / rank | GPUs | inter-node GiB/s | exact-unbalanced s | distca s | distca-comm s "
        "| ideal s | distca speedup | distca-comm speedup | ideal speedup | share of ideal gain: distca "
        "| distca-comm | fastest exact system (measurable) | distca-pingpong share (projection) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]

    def step(r: dict[str, Result], name: str) -> str:
        return f"{r[name].step_s:.2f}" if name in r else "-"

    def speedup(r: dict[str, Result], name: str) -> str:
        return f"{r['exact-unbalanced'].step_s / r[name].step_s:.2f}x" if name in r else "-"

    def share(r: dict[str, Result], name: str) -> str:
        return _share(ideal_gain_share(r, name)) if name in r else "-"

    for row in rows:
        r = row.results
        if "exact-unbalanced" not in r:
            continue
        base, ideal = r["exact-unbalanced"].step_s, r["exact-unbalanced"].ideal_step_s
        exact = {k: v for k, v in r.items() if k not in ("hf-default", "distca-pingpong")}
        best = min(r.step_s for r in exact.values())
        fastest = " = ".join(k for k, r in exact.items() if r.step_s <= best * (1 + 1e-9))  # ties: all
        lines.append(
            f"| {row.workload} | {row.tokens_per_rank} | {row.world} | {_fmt_bw(row.inter_gibps)} | {base:.2f} "
            f"| {step(r, 'distca')} | {step(r, 'distca-comm')} | {ideal:.2f} | {speedup(r, 'distca')} "
            f"| {speedup(r, 'distca-comm')} | {base / ideal:.2f}x | {share(r, 'distca')} | {share(r, 'distca-comm')} "
            f"| {fastest} | {share(r, 'distca-pingpong')} |"
        )
    lines += [
        "",
        "## Communication: the balance-only planner (distca) against the communication-aware one (distca-comm)",
        "",
        "Per step: exposed all-to-all seconds, GiB the busiest sender sends, its bytes over the mean rank's, the "
        "share of all bytes that cross nodes, and the KV fan-out: the most servers that read one document's KV "
        "prefix from the same holder (each one more copy it sends per layer).",
        "",
        "| workload | tokens / rank | GPUs | inter-node GiB/s | system | step s | exposed comm s | GiB sent (max rank) "
        "| max / mean rank | across nodes | KV fan-out |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        for name in ("exact-unbalanced", "distca", "distca-comm"):
            if name not in row.results:
                continue
            res = row.results[name]
            lines.append(
                f"| {row.workload} | {row.tokens_per_rank} | {row.world} | {_fmt_bw(row.inter_gibps)} | {name} "
                f"| {res.step_s:.2f} | {res.exposed_comm_s:.2f} | {res.sent_gib_max:.1f} | {res.sent_max_over_mean:.1f} "
                f"| {res.inter_node_share:.0%} | {res.kv_fanout} |"
            )
    groups: dict[tuple[str, int], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.workload, row.tokens_per_rank), []).append(row)
    for (workload, tokens_per_rank), group in groups.items():
        lines += [
            "",
            f"## {workload}, {tokens_per_rank} tokens per rank",
            "",
            "| GPUs | inter-node GiB/s | system | step s | tokens/s | MFU | busy max / mean s | imbalance "
            "| exposed comm s | GiB sent (max rank) | ideal s | gap to ideal |",
            "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in group:
            for name, res in row.results.items():
                lines.append(
                    f"| {row.world} | {_fmt_bw(row.inter_gibps)} | {name} | {res.step_s:.2f} | {res.tokens_per_s:,.0f} "
                    f"| {res.mfu:.1%} | {res.busy_max_s:.2f} / {res.busy_mean_s:.2f} | {res.imbalance:.2f} "
                    f"| {res.exposed_comm_s:.2f} | {res.sent_gib_max:.1f} | {res.ideal_step_s:.2f} "
                    f"| {res.gap_to_ideal:+.1%} |"
                )
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], path: str) -> None:
    """Tokens/s per GPU against the GPU count: one panel per workload and token budget, one line per
    system, the ideal dashed; the highest inter-node bandwidth where several were simulated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple[str, int], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.workload, row.tokens_per_rank), []).append(row)
    cols = len({t for _, t in groups})
    nrows = math.ceil(len(groups) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 3.6 * nrows), squeeze=False)
    for ax, ((workload, tokens_per_rank), group) in zip(axes.flat, groups.items(), strict=False):
        best: dict[int, Row] = {}
        for row in group:
            if row.world not in best or (row.inter_gibps or 0) > (best[row.world].inter_gibps or 0):
                best[row.world] = row
        worlds = sorted(best)
        names = list(best[worlds[0]].results)
        for name in names:
            label = f"{name} (not exact)" if name == "hf-default" else name
            ax.plot(worlds, [best[w].results[name].tokens_per_s / w for w in worlds], marker="o", label=label)
        ideal = [best[w].results[names[0]].ideal_step_s for w in worlds]
        tokens = [best[w].results[names[0]].tokens_per_s * best[w].results[names[0]].step_s for w in worlds]
        ax.plot(worlds, [t / i / w for t, i, w in zip(tokens, ideal, worlds)], "k--", label="ideal")
        ax.set_xscale("log", base=2)
        inter = max((row.inter_gibps or 0) for row in group)
        link = f", {inter:g} GiB/s between nodes" if inter else ""
        ax.set_title(f"{workload}, {tokens_per_rank // 1024}K tokens/rank{link} (simulated)", fontsize=9)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("tokens/s per GPU")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(groups) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--workload",
        action="append",
        required=True,
        help="'long-mix', a JSON file of document lengths, or name=FILE; repeat for several",
    )
    p.add_argument("--gpus", type=int, nargs="+", default=[2, 8, 64, 512])
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--tokens-per-rank", type=int, nargs="+", default=[32768, 65536])
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps simulated per setting")
    p.add_argument("--seed", type=int, default=0, help="document draw and shuffle (as the recipe's --seed)")
    p.add_argument(
        "--num-documents",
        type=int,
        default=None,
        help="documents drawn (as the recipe's --num-documents); default: enough for --steps",
    )
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument(
        "--tolerance",
        type=float,
        default=DistCAConfig().tolerance,
        help="planner tolerance of the distca systems (DistCAConfig.tolerance)",
    )
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--recompute", choices=("remat", "full"), default="remat")
    p.add_argument("--kernel-table", default=None, help="JSON from python -m hf_distca.calibrate")
    p.add_argument(
        "--inter-node-gibps", type=float, nargs="+", default=[23.3, 46.6], help="per GPU, one row each"
    )
    p.add_argument(
        "--intra-link",
        choices=("nvlink", "host"),
        default="nvlink",
        help="host: the 2-GPU all-to-all as measured with NCCL_P2P_DISABLE=1",
    )
    p.add_argument("--linear-us-per-token-layer", type=float, default=None, help="override the fit")
    p.add_argument("--linear-us-per-token-fixed", type=float, default=0.0)
    p.add_argument("--out", default=None, help="markdown file to write (a PNG of the same name beside it)")
    return p


def portable(arg: str, placeholder: str = "<data>") -> str:
    """A command-line argument with the directory of an absolute file path replaced by ``placeholder``
    (results files name no machine's paths)."""
    name, sep, path = arg.rpartition("=")
    if os.path.isabs(path):
        return f"{name}{sep}{placeholder}/{os.path.basename(path)}"
    return arg


def main(argv: Sequence[str] | None = None) -> list[Row]:
    args = build_parser().parse_args(argv)
    for name in ("gpus", "tokens_per_rank"):
        if min(getattr(args, name)) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    rows, info = run_grid(args)
    argv = list(argv if argv is not None else sys.argv[1:])
    command = "python benchmarks/simulate.py " + " ".join(shlex.quote(portable(a)) for a in argv)
    report = write_report(rows, info, args, command)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
        plot(rows, os.path.splitext(args.out)[0] + ".png")
        print(f"wrote {args.out} and {os.path.splitext(args.out)[0]}.png")
    else:
        print(report)
    return rows


if __name__ == "__main__":
    main()
