"""What the simulator prices work with: the model's shape, the measured kernel, link and non-attention tables,
and the setting of one simulated run. Every figure is a measurement on H200s, named where it comes from."""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hf_distca.config import DistCAConfig
from hf_distca.planning import MeasuredCost
from hf_distca.planning.cost import causal_pairs
from hf_distca.planning.links import layer_seconds_per_token
from hf_distca.planning.traffic import INTRA, link_classes

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
"""(bytes per rank, GiB/s): NCCL all_to_all_single between 2 H200s over NVLink (measured
on the project's machines, torch 2.11; the figures live here, in no results file)."""
HOST_STAGED_GIBPS = 22.0
"""GiB/s of the same all-to-all with NCCL_P2P_DISABLE=1 (21-23 from 16 MiB to 1 GiB;
measured as :data:`NVLINK_ALL_TO_ALL`)."""
STRAGGLER_4_LAYERS = {2048: 1.33, 8192: 1.52, 32768: 2.23, 65536: 3.18}
"""Document length -> seconds of forward+backward of 65536 tokens of such documents through a 4-layer
Llama-3-8B-shaped stack (128K vocabulary, gradient checkpointing, varlen attention) on 1 H200, torch 2.11
(measured on the project's machines; the figures live here)."""
NON_ATTENTION_8_LAYERS = 2.3
"""Seconds of the non-attention part of a step of 65536 tokens per rank, 8 layers, on 2 x H200:
the per-step fit of step time against the slowest rank's attention FLOPs (measured on the project's
machines; the figure lives here)."""
FLOP_RATIO_FWD_BWD = 3.5
"""forward+backward over forward FLOPs of attention (backward ~2.5 forward), the kernels table's convention."""


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
        hf_distca.engine.pricing.decoder_layer_weights counts them on a model)."""
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
        """Fit to the H200 measurements above (:data:`STRAGGLER_4_LAYERS`, :data:`NON_ATTENTION_8_LAYERS`): the 4-layer stack's step minus its attention (forward twice
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
            per_layer / 65536,
            (four - 4 * per_layer) / 65536,
            "fitted to the H200 measurements of benchmarks/sim/costs.py",
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
