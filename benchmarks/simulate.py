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
  DistCAConfig's: 0.1 for it, 0.02 for the planners that price communication; balancing compute only),
  ``distca-comm`` (the same planner pricing communication on the simulated links:
  ``DistCAConfig(link_gib_per_s=--inter-node-gibps, ranks_per_node=--gpus-per-node,
  intra_node_gib_per_s=the intra-node all-to-all at 256 MiB per rank)``, see :func:`planner_config`,
  and the layout DistCACallback builds from that config: documents cut inside one node; under layer-level
  ping-pong also ``layer_ping_pong=True`` with ``layer_seconds_per_token`` derived as
  :func:`hf_distca.enable_distca` derives it, from the layer's weights at the default ``layer_tflops``:
  the planner prices transfers as hidden behind the other nano-batch's layers),
  ``distca-pingpong`` / ``distca-comm-pingpong`` (those plans under attention-level ping-pong,
  ``DistCAConfig(ping_pong=True)``: the engine's nano-batches inside each attention call,
  hf_distca.planning.nano) and ``distca-layers`` / ``distca-comm-layers`` (layer-level ping-pong: the
  micro-batch's whole documents in two nano-batches of about equal estimated cost, each laid out over all
  ranks at its own tokens per rank (the fewest that hold it) and planned on its own, as the data path does:
  :func:`hf_distca.data.nano.split_documents` and :func:`~hf_distca.data.nano.nano_tokens_per_rank`; a
  micro-batch of one document runs whole, serial; run through the layers as coroutines that switch at the
  attention function). Not run by default (``--systems``): ``distca-comm-layers4`` (4 nano-batches),
  ``-shard1k`` (1024-token shards) and ``-exposed`` (the planner prices every transfer exposed).
  ``distca-comm-layers-relay``: distca-comm-layers with ``DistCAConfig(kv_relay=True)``, KV rows
  crossing nodes once per destination node through a relay rank (:mod:`hf_distca.planning.relay`; each
  phase that carries KV is two all-to-alls, back to back, as the engine chains them).
- padding: the systems through DistCA's data path (all but hf-default) lay out a micro-batch that runs
  whole at the fewest tokens per rank that hold it, as ``DistCAConfig.pad_to_budget=False`` (the default)
  makes ``DistCABatches`` do, and as nano-batches always are; ``--pad-to-budget``: at ``--tokens-per-rank``
  (padding runs through the non-attention work). hf-default packs to the budget.
- core attention: every CA-task (queries [a, b) of a document over keys [0, b)) costs its causal
  (query, key) pairs over the measured rate of its shape, per layer: forward + backward (the
  ``remat`` recompute mode, rematerialization-aware checkpointing: attention is not run again) or
  forward twice + backward (``full``: plain activation recompute). Kernel table: the figures of
  benchmarks/results/kernels_h200.md (whole documents of 512-32K tokens; a task's rate is taken as
  the measured rate of whole documents as long as its query shard, so short shards over long prefixes
  are priced conservatively; the forward alone from the measured forward times), or ``--kernel-table``,
  a JSON table written by ``python -m hf_distca.calibrate`` (q_len x kv_len -> seconds of a task,
  forward+backward; the forward alone is then taken as 1/3.5 of it, the FLOP ratio), e.g. the shipped
  hf_distca/cost_tables/h200_bf16_32x8x128_torch_varlen.json. With such a table the DistCA systems also
  plan with it, as the engine does on an H200 (``DistCAConfig(cost_table="auto")``: measured kernel time,
  not pairs); with the whole-document rows they plan causal pairs (:func:`planner_config`).
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
  first segment) and inter-node traffic (flat ``--inter-node-gibps``) proceed at the same time.
  ``--intra-link host`` prices the 2-GPU link as measured with ``NCCL_P2P_DISABLE=1`` (~22 GiB/s).
- step time: the engine's schedule of each micro-batch (hf_distca.planning.schedule: serial, attention-level
  or layer-level ping-pong; per layer, forward and backward, the non-attention work before attention (norm,
  QKV, RoPE: its share of the layer's matmul weights) and after it (o_proj, MLP), the four all-to-all
  phases of each nano-batch and part, the server kernels), timed by its list scheduler: per rank one compute
  stream and one communication channel, every all-to-all a collective that starts once every rank has
  started it (and the previous one has ended) and lasts as long as its slowest rank; a wait blocks the
  compute stream. What stays exposed is whatever the schedule leaves uncovered (the first dispatch, the last
  return, phases longer than the work beside them). Non-attention work of a layer: ``FORWARD_SHARE`` of it
  in forward, the rest (recompute and backward) in backward. Summed over micro-batches; ``hf-default`` only
  synchronises at the gradient reduction: max over ranks of its summed work. Gradient all-reduce is the same
  for every system and left out. The serial schedule is what benchmarks/check_simulator.py checks against
  the 1-2 GPU measurements.
- ideal bound: perfect balance and no exposed communication: the exact computation's total work of the
  real tokens (:func:`ideal_work`: no padding, every document's attention whole in one kernel) divided by
  the number of GPUs. Padding (a micro-batch's, or under layer-level ping-pong each nano-batch's, tokens
  per rank beyond its documents) is work of the system, in its 'kernels' part of the gap.
- MFU: model FLOPs of the step (6 x matmul parameters per real token, plus causal attention 3 x 4 x
  heads x head_dim per (query, key) pair per layer, exact for every system) over step time x GPUs x
  989 TFLOP/s. tokens/s counts real (not padding) tokens.

    python -m benchmarks.simulate --workload pretrain=PATH/doclens_pretrain.json \\
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
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hf_distca.config import BALANCE_ONLY_TOLERANCE, PRICED_TOLERANCE, DistCAConfig
from hf_distca.data.baselines import LAYOUTS
from hf_distca.data.nano import nano_tokens_per_rank, split_documents, whole_tokens_per_rank
from hf_distca.planning import MeasuredCost, plan_core_attention
from hf_distca.planning import schedule as schedule_ops
from hf_distca.planning.cost import causal_pairs, cost_model_from_config
from hf_distca.planning.links import LAYER_FORWARD_SHARE, attention_flops_per_pair, layer_seconds_per_token
from hf_distca.planning.nano import nano_plans
from hf_distca.planning.relay import relay_kv_bytes
from hf_distca.planning.traffic import (
    INTER,
    INTRA,
    PHASES,
    forward_phases,
    link_classes,
    phase_matrices,
    plan_matrices,
    relays,
)
from hf_distca.planning.window import kv_start

from .workloads import documents_for, draw_lengths, global_batches, load_sample

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

SYSTEMS = (
    "hf-default",
    "exact-unbalanced",
    "balanced",
    "distca",
    "distca-comm",
    "distca-pingpong",
    "distca-comm-pingpong",
    "distca-layers",
    "distca-comm-layers",
    "distca-comm-layers-relay",
)
BASELINES = ("exact-unbalanced", "balanced")
"""The exact baselines a DistCA system must never be slower than (hf-default computes other math)."""
GOAL = 0.9
"""The share of the ideal gain DistCA aims at (issue 17); rows below it say what is left."""
SCHEDULES = ("serial", "attention", "layers")
"""How DistCA's engine runs a micro-batch (hf_distca.planning.schedule): serial, attention-level ping-pong
(``DistCAConfig(ping_pong=True)``: nano-batches inside each attention call), layer-level ping-pong (two
nano-batches of documents through the layers as coroutines)."""


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
    schedule: str = "serial"
    """One of SCHEDULES (systems through DistCA's engine)."""
    comm_aware: bool = False
    """The planner prices moves against the simulated links (``DistCAConfig(link_gib_per_s=inter-node,
    intra_node_gib_per_s=..., ranks_per_node=GPUs per node)``, see :func:`planner_config`)."""
    nanos: int = 2
    """Nano-batches of layer-level ping-pong."""
    shard_tokens: int | None = None
    """The planner's shard granularity (None: DistCAConfig's)."""
    hide_window: bool = True
    """With ``comm_aware`` and the 'layers' schedule: the planner prices transfers as hidden behind the
    other nano-batch's layers (``DistCAConfig(layer_ping_pong=True)``, ``layer_seconds_per_token``
    derived from the layer's weights as enable_distca does); False: every transfer exposed."""
    kv_relay: bool = False
    """``DistCAConfig(kv_relay=True)``: KV rows cross nodes once per destination node, to the rank of that
    node at the holder's position in its node, which forwards them inside the node (dK/dV back the reverse
    way): each phase that carries KV runs two all-to-alls, one after the other
    (:func:`hf_distca.planning.relay.relay_kv_bytes`); the communication-aware planner prices the relay."""


SYSTEM_SPECS = {
    "hf-default": System("hf-default", "hf-default", False, False),
    "exact-unbalanced": System("exact-unbalanced", "tokens", True, False),
    "balanced": System("balanced", "balanced", True, False),
    "distca": System("distca", "distca", True, True),
    "distca-comm": System("distca-comm", "distca", True, True, comm_aware=True),
    "distca-pingpong": System("distca-pingpong", "distca", True, True, "attention"),
    "distca-comm-pingpong": System(
        "distca-comm-pingpong", "distca", True, True, "attention", comm_aware=True
    ),
    "distca-layers": System("distca-layers", "distca", True, True, "layers"),
    "distca-comm-layers": System("distca-comm-layers", "distca", True, True, "layers", comm_aware=True),
    # what else could close the gap (issue 17), not run by default: more, smaller nano-batches; larger
    # shards (fewer, longer cuts)
    "distca-comm-layers4": System("distca-comm-layers4", "distca", True, True, "layers", True, nanos=4),
    "distca-comm-layers-shard1k": System(
        "distca-comm-layers-shard1k", "distca", True, True, "layers", True, shard_tokens=1024
    ),
    # the priced planner without the window layer ping-pong hides transfers behind (every transfer exposed)
    "distca-comm-layers-exposed": System(
        "distca-comm-layers-exposed", "distca", True, True, "layers", True, hide_window=False
    ),
    # distca-comm-layers with KV through the per-node relay
    "distca-comm-layers-relay": System(
        "distca-comm-layers-relay", "distca", True, True, "layers", True, kv_relay=True
    ),
}
EXPLORATIONS = (
    "distca-comm-layers4",
    "distca-comm-layers-shard1k",
    "distca-comm-layers-exposed",
)


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
    def layer_weights(self) -> int:
        """Weights of one decoder layer's matmuls: attention projections and MLP (as
        hf_distca.attention.decoder_layer_weights counts them on a model)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.intermediate

    @property
    def derived_layer_seconds(self) -> float:
        """The seconds per token of one layer that enable_distca derives for layer-level ping-pong's planner
        (its weights at the default DistCAConfig.layer_tflops)."""
        return layer_seconds_per_token(self.layer_weights, DistCAConfig().layer_tflops)

    @property
    def matmul_params(self) -> int:
        """Weights multiplied per token: attention projections, MLP, LM head (not the embedding lookup)."""
        return self.layers * self.layer_weights + self.hidden * self.vocab

    def model_flops(self, doc_lengths: Sequence[int]) -> float:
        """Forward+backward model FLOPs of these documents (causal attention counted exactly)."""
        pairs = sum(causal_pairs(0, n) for n in doc_lengths)
        return (
            6.0 * self.matmul_params * sum(doc_lengths)
            + 12.0 * self.heads * self.head_dim * self.layers * pairs
        )


class KernelTable:
    """Seconds of one layer's core attention of a CA-task, forward and forward+backward."""

    def __init__(
        self, forward: MeasuredCost, forward_backward: MeasuredCost, source: str, path: str | None = None
    ):
        self.forward = forward
        self.forward_backward = forward_backward
        self.source = source
        self.path = path
        """The measured (q_len, kv_len) JSON table it was read from (None: whole-document rows), which
        the DistCA systems' planner then balances too (:func:`planner_config`)."""

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
            os.path.abspath(path),
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
    pad_to_budget: bool = False
    """``DistCAConfig.pad_to_budget``: DistCA's data path lays out a micro-batch that runs whole at
    ``tokens_per_rank`` (True) or at the fewest tokens per rank that hold it (False, the default)."""


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


def planner_config(system: System, s: Setting, tolerance: float | None = None) -> DistCAConfig:
    """The DistCAConfig a system's planner runs with: ``tolerance`` (default DistCAConfig's), no move
    without balancing, and for ``comm_aware`` systems the simulated links: ``link_gib_per_s`` the
    inter-node bandwidth, ``ranks_per_node`` the GPUs per node, ``intra_node_gib_per_s`` the intra-node
    all-to-all's bandwidth at 256 MiB per rank (the planner takes one flat figure per link class). What
    it balances: the kernel table the step is timed with when that is a measured (q_len, kv_len) JSON
    (``--kernel-table``, ``cost_table=`` its path: what ``cost_table="auto"`` gives the engine on an H200
    with bf16 32/8 x 128 heads, the shipped hf_distca/cost_tables/h200_bf16_32x8x128_*.json), else causal
    pairs (``cost_table=None``; the whole-document rows are no (q_len, kv_len) table)."""
    fields = {
        "tolerance": tolerance,
        "max_planner_moves": DistCAConfig().max_planner_moves if system.balance else 0,
        "cost_table": s.kernels.path,
    }
    if system.shard_tokens is not None:
        fields["shard_tokens"] = system.shard_tokens
    if system.comm_aware:
        fields.update(
            link_gib_per_s=s.links.inter_gibps,
            ranks_per_node=s.links.gpus_per_node,
            intra_node_gib_per_s=s.links.intra_gibps_at(PLANNER_INTRA_BYTES),
        )
        fields["kv_relay"] = system.kv_relay
        if system.schedule == "layers" and system.hide_window:
            # what the other nano-batch's layers hide, as enable_distca derives it from the model's layer
            # weights at the default layer_tflops
            fields.update(layer_ping_pong=True, layer_seconds_per_token=s.model.derived_layer_seconds)
    return DistCAConfig(**fields)


def plan_layout(
    system: System, lengths: Sequence[int], s: Setting, tokens_per_rank: int, tolerance: float | None = None
):
    """(pieces of ``system``'s layout of these documents, its plan through DistCA's engine or None,
    wall seconds of planning). Cached: systems and link settings that plan alike share one plan."""
    config = planner_config(system, s, tolerance)
    model = s.model
    return _planned(
        system.layout, system.disaggregate, tuple(int(n) for n in lengths), s.world, tokens_per_rank, config,
        model.q_row_bytes, model.kv_row_bytes, attention_flops_per_pair(model.heads, model.head_dim),
    )  # fmt: skip


@functools.lru_cache(maxsize=32)
def _planned(layout_name, disaggregate, lengths, world, tokens_per_rank, config, q_row, kv_row, flops):
    layout = LAYOUTS[layout_name]
    if layout_name == "distca":  # as DistCACallback's default: cut documents inside a node when it is known
        layout = functools.partial(layout, ranks_per_node=config.ranks_per_node)
    pieces = layout(lengths, world_size=world, tokens_per_rank=tokens_per_rank)
    if not disaggregate:
        return pieces, None, 0.0
    began = time.process_time()  # CPU seconds: the planner's cost, not the wait for a shared machine's cores
    plan = plan_core_attention(
        pieces, q_row_bytes=q_row, kv_row_bytes=kv_row, config=config, flops_per_pair=flops,
        cost_model=cost_model_from_config(config),
    )  # fmt: skip
    return pieces, plan, time.process_time() - began


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
    'layers'), timed on their schedule (hf_distca.planning.schedule): per rank and layer the
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
            parts = nano_plans(plan, config.shard_tokens, split or config.ping_pong_split)
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


# ---------------------------------------------------------------------------------------- the report


@dataclass
class Row:
    workload: str
    tokens_per_rank: int
    world: int
    inter_gibps: float | None
    """None for a single node (the inter-node bandwidth does not matter)."""
    results: dict[str, Result]

    @property
    def setting_cells(self) -> str:
        """The row's cells under :data:`SETTING_COLUMNS` of a report table."""
        return f"| {self.workload} | {self.tokens_per_rank} | {self.world} | {_fmt_bw(self.inter_gibps)} |"


SETTING_COLUMNS = "| workload | tokens / rank | GPUs | inter-node GiB/s |"
"""The first columns of the report's tables across settings (:attr:`Row.setting_cells`)."""
SETTING_ALIGN = "|---|---:|---:|---:|"


def _ran(rows: list[Row], systems: Sequence[str]) -> list[tuple[Row, str, Result]]:
    """(row, system, result) of each of ``systems`` that ran in each row, row by row in ``systems``' order."""
    return [(row, name, row.results[name]) for row in rows for name in systems if name in row.results]


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
    tasks = []
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
                settings = []
                for inter in bandwidths:
                    links = Links(args.gpus_per_node, intra, inter or args.inter_node_gibps[0])
                    settings.append((inter, Setting(world, tokens_per_rank, model, kernels, links, linear,
                                                    args.recompute, args.grad_accum, args.pad_to_budget)))  # fmt: skip
                tasks.append((name, tokens_per_rank, world, steps, settings, args.systems, args.tolerance))
    if args.jobs > 1:  # settings in parallel processes (forked: the tables come along), rows in order
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            per_task = pool.map(_run_setting, tasks, chunksize=1)
    else:
        per_task = [_run_setting(task) for task in tasks]
    rows = [row for task_rows in per_task for row in task_rows]
    for row in rows:
        log(f"{row.workload} {row.tokens_per_rank} x {row.world} GPUs, inter {row.inter_gibps}: "
            + ", ".join(f"{k} {r.step_s:.2f}s" for k, r in row.results.items()))  # fmt: skip
    info = {
        "model": model,
        "kernels": kernels.source,
        "linear": linear,
        "intra": intra,
        "planner_table": kernels.path is not None,
    }
    return rows, info


def _run_setting(task) -> list[Row]:
    """The rows of one workload, token budget and GPU count (one per inter-node bandwidth; the plans that
    do not depend on the links are made once)."""
    name, tokens_per_rank, world, steps, settings, systems, tolerance = task
    rows = []
    for inter, setting in settings:
        began = time.perf_counter()
        results = simulate(systems, steps, setting, tolerance)
        rows.append(Row(name, tokens_per_rank, world, inter, results))
        print(
            f"[{time.perf_counter() - began:.0f} s] {name} {tokens_per_rank} x {world}, inter {inter}",
            flush=True,
        )
    return rows


def _share(share: float | None) -> str:
    return "n/a (< 2% to gain)" if share is None else f"{share:.0%}"


def _fmt_bw(gibps: float | None) -> str:
    return "-" if gibps is None else f"{gibps:g}"


def system_settings(system: System, info: dict) -> str:
    """The DistCAConfig a DistCA system runs with, in words, saying which settings are not DistCA's
    defaults (the report's headline)."""
    tolerance = PRICED_TOLERANCE if system.comm_aware else BALANCE_ONLY_TOLERANCE
    fields = [f"tolerance {tolerance:g} (the default for its planner) unless --tolerance"]
    fields.append(
        "cost_table=the kernel table (measured kernel time, as the default 'auto' on an H200)"
        if info["planner_table"]
        else "cost_table=None (causal pairs)"
    )
    if system.comm_aware:
        fields.append(
            "link_gib_per_s=the inter-node figure, ranks_per_node=GPUs per node, intra_node_gib_per_s=the "
            "intra-node all-to-all at 256 MiB (not defaults: the links must be given)"
        )
    if system.schedule == "attention":
        fields.append("ping_pong=True (not the default)")
    if system.schedule == "layers":
        fields.append(
            "layer_ping_pong=True, not DistCA's default (DistCAConfig.layer_ping_pong is False until measured "
            f"on 2 or more GPUs), {system.nanos} nano-batches"
        )
        if system.comm_aware and system.hide_window:
            fields.append(
                "layer_seconds_per_token None, derived as enable_distca does from the layer's weights at the "
                "default layer_tflops (each phase priced as exposed only beyond the other nano-batch's work it "
                "flies behind)"
            )
    if system.shard_tokens is not None:
        fields.append(f"shard_tokens={system.shard_tokens}")
    if system.kv_relay:
        fields.append("kv_relay=True (KV rows cross nodes once per destination node, through a relay rank)")
    if not system.balance:
        fields.append("max_planner_moves=0")
    return "DistCAConfig(" + "; ".join(fields) + ")" if system.disaggregate else "not through DistCA's engine"


def _tolerance(args, default: float) -> str:
    """The tolerance a planner ran with, in words: --tolerance, or its default."""
    return f"{default:g}, DistCAConfig's default" if args.tolerance is None else f"{args.tolerance:g}"


def write_report(rows: list[Row], info: dict, args, command: str) -> str:
    linear: LinearCost = info["linear"]
    model: ModelShape = info["model"]
    lines = [
        f"# Simulated step times: DistCA and baselines on {', '.join(map(str, args.gpus))} GPUs",
        "",
        "**These are simulated figures, not measurements.** They come from benchmarks/simulate.py, which "
        "prices the real layouts and the real DistCA planner's plans with measured tables; read its "
        "docstring for the model. Checked against the measured steps of 1 and 2 x H200 in "
        "benchmarks/results/simulator_check_2xh200.md (benchmarks/check_simulator.py: what it found, row by row; "
        "among it, layer-level ping-pong's split of a micro-batch is priced as free); nothing past 2 GPUs has "
        "been measured. Generated on a CPU machine "
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
        "- padding: "
        + (
            "every micro-batch that runs whole is laid out at --tokens-per-rank (--pad-to-budget, "
            "DistCAConfig(pad_to_budget=True)): its unfilled room runs through the non-attention work as padding"
            if args.pad_to_budget
            else "the systems through DistCA's data path (all but hf-default) lay out a micro-batch that runs "
            "whole at the fewest tokens per rank that hold it (DistCAConfig.pad_to_budget=False, the default; "
            "nano-batches always are); hf-default packs to --tokens-per-rank"
        ),
        "- schedules (hf_distca.planning.schedule, timed by its list scheduler: per rank one compute stream "
        "and one communication channel, every all-to-all a collective that starts once every rank has started "
        "it and lasts as long as the slowest rank's transfer; a wait blocks the compute stream): serial for "
        "exact-unbalanced, balanced, distca and distca-comm (every exchange exposed); attention-level and "
        "layer-level ping-pong for the *-pingpong and *-layers systems. Each layer's non-attention work is "
        f"split {FORWARD_SHARE:g} forward / {1 - FORWARD_SHARE:g} backward with its recompute, and "
        "before / after attention by matmul weights (QKV against o_proj and MLP)",
        "- what the DistCA systems' planner balances: "
        + (
            "the kernel table above, DistCAConfig(cost_table=its path): measured kernel time, as "
            'cost_table="auto" (the default) plans on an H200 with bf16 32/8 x 128 heads'
            if info["planner_table"]
            else "causal pairs, DistCAConfig(cost_table=None) (the whole-document rows are no (q_len, kv_len) "
            "table), priced at the default attention_tflops=300 (forward+backward) where communication is priced"
        ),
        "- distca-comm's planner: DistCAConfig(link_gib_per_s=the inter-node figure, ranks_per_node="
        f"{args.gpus_per_node}, intra_node_gib_per_s=the intra-node all-to-all at 256 MiB per rank), "
        "comm_overlap=0; for distca-comm-layers also layer_ping_pong=True, layer_seconds_per_token="
        f"{model.derived_layer_seconds:.4g} (derived as "
        "enable_distca derives it: the layer's weights at the default layer_tflops; the simulated "
        f"non-attention work above is {linear.per_token_layer:.4g}): transfers "
        "priced as hidden behind the other nano-batch's layer work and kernels (hf_distca.planning.links."
        "hiding_window; distca-comm-layers-exposed: without it)",
        "",
        "Systems: hf-default (each rank packs whole documents in order, attention local to each piece; "
        "documents longer than the budget become independent chunks: **the math differs**), "
        "exact-unbalanced (the token-only rebatcher layout, layout_pieces, DistCA engine with balancing off: "
        "max_planner_moves=0), balanced (WLB-LLM-style balanced packing with per-document context "
        "parallelism, layout_balanced, exact, planner off), distca (DistCA's default: the same balanced "
        f"layout and the planner, tolerance {_tolerance(args, BALANCE_ONLY_TOLERANCE)}, balancing compute only), "
        f"distca-comm (tolerance {_tolerance(args, PRICED_TOLERANCE)}, the "
        "same with communication-aware planning: each move priced by the compute time it saves against the "
        "transfer time it adds on the simulated links; its layout cuts documents inside one node), "
        "distca-pingpong and distca-comm-pingpong (those plans run with attention-level ping-pong, "
        "DistCAConfig(ping_pong=True), its default split: nano-batches inside each attention call, messages "
        "hidden only behind kernels of the same call), distca-layers and distca-comm-layers (layer-level "
        "ping-pong, DistCAConfig(layer_ping_pong=True), not DistCA's default: the micro-batch's whole "
        "documents in two nano-batches of about equal estimated cost, each laid out over all ranks at its "
        "own tokens per rank (the fewest that hold it) and planned on its own, as the data path does (hf_distca.data.nano), run "
        "through the layers as coroutines in the engine's order (hf_distca.planning.schedule.layer_ping_pong, "
        "asserted against the engine's stages by tests/test_layer_ping_pong.py): while one nano-batch's "
        "messages fly the other runs its projections, MLP or layer backward), distca-comm-layers-relay "
        "(distca-comm-layers with DistCAConfig(kv_relay=True), hf_distca.planning.relay: a KV row crosses nodes "
        "once per destination node, to the node's rank at the holder's position in its node, which forwards it "
        "to the servers of its node that read it; each phase that carries KV is two all-to-alls back to back, as "
        "the engine chains them; its planner prices the relay; on one node the same as distca-comm-layers). "
        "Ideal: the exact computation of "
        "the real tokens (no padding, every document's attention whole in one kernel) perfectly balanced with no "
        "exposed communication. 'share of ideal gain': (speedup - 1) / (ideal speedup - 1), both against "
        "exact-unbalanced.",
        "",
        "## DistCA against the ideal",
        "",
        f"Headline system: **{args.headline}**: {system_settings(SYSTEM_SPECS[args.headline], info)}. 'share': of the ideal gain; 'over balanced': balanced's step over the headline's "
        "(the DistCA paper compares with WLB-LLM-style balancing and reports 1.07-1.35x); 'best baseline': the "
        "fastest exact baseline (exact-unbalanced, balanced). 'left': where the headline's share is under "
        f"{GOAL:.0%}, the seconds between its step and the ideal, as exposed communication / residual imbalance / "
        "kernels and padding (Result.left: step - synced, synced - mean busy, mean busy - ideal; they add up to "
        "the gap).",
        "",
        SETTING_COLUMNS + " exact-unbalanced s | best baseline s | ideal s "
        f"| {args.headline} s | share of ideal gain | over balanced | vs best baseline | left (s): comm / imbalance "
        "/ kernels |",
        SETTING_ALIGN + "---:|---:|---:|---:|---:|---:|---:|---|",
    ]

    def share(r: dict[str, Result], name: str) -> str:
        return _share(ideal_gain_share(r, name)) if name in r else "-"

    head = args.headline
    for row in rows:
        r = row.results
        if "exact-unbalanced" not in r or head not in r:
            continue
        base, ideal = r["exact-unbalanced"].step_s, r["exact-unbalanced"].ideal_step_s
        baselines = {k: r[k] for k in BASELINES if k in r}
        best = min(baselines.values(), key=lambda x: x.step_s)
        h = r[head]
        over = f"{r['balanced'].step_s / h.step_s:.2f}x" if "balanced" in r else "-"
        gain = ideal_gain_share(r, head)
        left = "-" if gain is None or gain >= GOAL else " / ".join(f"{x:.2f}" for x in h.left())
        lines.append(
            row.setting_cells + f" {base:.2f} "
            f"| {best.step_s:.2f} ({best.system}) | {ideal:.2f} | {h.step_s:.2f} | {_share(gain)} | {over} "
            f"| {best.step_s / h.step_s:.3f}x | {left} |"
        )
    distca = [
        k for k in SYSTEMS + EXPLORATIONS if k.startswith("distca") and any(k in row.results for row in rows)
    ]
    lines += [
        "",
        "## Every DistCA schedule and planner: share of the ideal gain",
        "",
        "distca / distca-comm: serial engine (balance-only / communication-aware planner); *-pingpong: "
        "attention-level ping-pong (nano-batches inside each attention call); *-layers: layer-level ping-pong "
        "(two nano-batches of documents through the layers as coroutines). Step seconds in brackets.",
        "",
        SETTING_COLUMNS + " " + " | ".join(distca) + " | best |",
        SETTING_ALIGN + "---:|" * len(distca) + "---|",
    ]
    for row in rows:
        r = row.results
        present = [k for k in distca if k in r]
        if not present or "exact-unbalanced" not in r:
            continue
        fastest = min(present, key=lambda k: r[k].step_s)
        cells = [f"{share(r, k)} ({r[k].step_s:.2f})" if k in r else "-" for k in distca]
        lines.append(row.setting_cells + " " + " | ".join(cells) + f" | {fastest} |")
    lines += [
        "",
        "## Where the time goes: exposed communication per phase",
        "",
        "Per step, seconds the last rank to finish waited while each phase's transfers ran (all layers, parts "
        "and nano-batches; the wait for other ranks to reach a collective counts as imbalance, not here), "
        "then the three parts of the gap to the ideal (Result.left).",
        "",
        SETTING_COLUMNS + " system | step s | comm s (all collectives) "
        "| exposed: " + " | ".join(PHASES) + " | left: comm / imbalance / kernels s |",
        SETTING_ALIGN + "---|---:|---:|" + "---:|" * len(PHASES) + "---|",
    ]
    for row, name, res in _ran(rows, distca):
        lines.append(
            row.setting_cells
            + f" {name} | {res.step_s:.2f} | {res.comm_s:.2f} | "
            + " | ".join(f"{res.exposed_by_phase.get(p, 0.0):.2f}" for p in PHASES)
            + " | "
            + " / ".join(f"{x:.2f}" for x in res.left())
            + " |"
        )
    lines += [
        "",
        "## Planning time against the step",
        "",
        "CPU time (the process's, not wall time: the machine is shared) of planning one step (every plan of "
        "its micro-batches: layer-level ping-pong plans its two nano-batches) on the CPU machine that ran "
        "this simulation, against the simulated step of the same system. The plan depends only on the data "
        "(every rank's pieces), the model's shapes and the config, so DistCAConfig(prefetch_plans=True) makes "
        "it for micro-batch N + 1 while micro-batch N trains. benchmarks/results/planner_cpu.md times the "
        "planner alone, per micro-batch.",
        "",
        SETTING_COLUMNS + " system | plan s | step s | plan / step |",
        SETTING_ALIGN + "---|---:|---:|---:|",
    ]
    for row, name, res in _ran([row for row in rows if row.world == max(args.gpus)], distca):
        lines.append(
            row.setting_cells
            + f" {name} | {res.plan_s:.2f} | {res.step_s:.2f} | {res.plan_s / res.step_s:.1%} |"
        )
    lines += [
        "",
        "## Communication: the balance-only planner (distca) against the communication-aware one (distca-comm)",
        "",
        "Per step: exposed all-to-all seconds, GiB the busiest sender sends, its bytes over the mean rank's, the "
        "share of all bytes that cross nodes, and the KV fan-out: the most servers that read one document's KV "
        "prefix from the same holder (each one more copy it sends per layer).",
        "",
        SETTING_COLUMNS + " system | step s | exposed comm s | GiB sent (max rank) "
        "| max / mean rank | across nodes | KV fan-out |",
        SETTING_ALIGN + "---|---:|---:|---:|---:|---:|---:|",
    ]
    for row, name, res in _ran(rows, ("exact-unbalanced", "distca", "distca-comm")):
        lines.append(
            row.setting_cells
            + f" {name} | {res.step_s:.2f} | {res.exposed_comm_s:.2f} | {res.sent_gib_max:.1f} "
            f"| {res.sent_max_over_mean:.1f} | {res.inter_node_share:.0%} | {res.kv_fanout} |"
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
    p.add_argument("--jobs", type=int, default=1, help="settings simulated in parallel processes")
    p.add_argument("--seed", type=int, default=0, help="document draw and shuffle (as the recipe's --seed)")
    p.add_argument(
        "--num-documents",
        type=int,
        default=None,
        help="documents drawn (as the recipe's --num-documents); default: enough for --steps",
    )
    p.add_argument("--systems", nargs="+", choices=SYSTEMS + EXPLORATIONS, default=list(SYSTEMS))
    p.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="planner tolerance of the distca systems (DistCAConfig.tolerance; default: DistCAConfig's, "
        f"{BALANCE_ONLY_TOLERANCE:g} balance-only, {PRICED_TOLERANCE:g} when communication is priced)",
    )
    p.add_argument(
        "--headline",
        choices=[k for k in SYSTEMS + EXPLORATIONS if k.startswith("distca")],
        default="distca",
        help="the DistCA system of the goal table (DistCA's default settings)",
    )
    p.add_argument("--layers", type=int, default=32)
    p.add_argument(
        "--pad-to-budget",
        action="store_true",
        help="DistCA's data path pads each whole micro-batch to --tokens-per-rank (DistCAConfig.pad_to_budget)",
    )
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
    command = "python -m benchmarks.simulate " + " ".join(shlex.quote(portable(a)) for a in argv)
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
