"""The systems the simulator compares (DistCA's configurations and its baselines) and how each lays out
and plans a micro-batch: the real layouts of hf_distca.data.baselines and the real planner under the
DistCAConfig each system runs with."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass

from hf_distca.config import DistCAConfig, cost_model_from_config
from hf_distca.data.baselines import LAYOUTS
from hf_distca.planning import plan_core_attention
from hf_distca.planning.links import attention_flops_per_pair

from .costs import Setting

PLANNER_INTRA_BYTES = 256 * 2**20
"""Per-rank all-to-all volume at which the comm-aware planner reads the intra-node bandwidth."""

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
SCHEDULES = ("serial", "attention", "layers")
"""How DistCA's engine runs a micro-batch (benchmarks/sim/schedule.py): serial, attention-level ping-pong
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
        pieces, q_row_bytes=q_row, kv_row_bytes=kv_row, options=config.planner_options(), flops_per_pair=flops,
        cost_model=cost_model_from_config(config),
    )  # fmt: skip
    return pieces, plan, time.process_time() - began
