"""Engine configuration: how core attention is planned and which kernel runs it."""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

from hf_distca.kernels import KERNEL_BACKENDS
from hf_distca.planning.cost import CausalPairsCost, MeasuredCost
from hf_distca.planning.options import PlannerOptions
from hf_distca.planning.ping_pong import PING_PONG_SPLITS

# DistCAConfig fields that change how a plan is run or checked, never the plan itself.
RUN_ONLY_FIELDS = (
    "backend",
    "layer_tflops",  # acts only through layer_seconds_per_token, which enable_distca derives from it
    "check_consistency",
    "ping_pong",
    "ping_pong_split",
    "layer_ping_pong",
    "prefetch_plans",
    "pad_to_budget",  # acts on the data path's layouts, which plans are keyed by anyway
)
# Where DistCAConfig fields take effect; every field named in neither tuple acts only in the disaggregated
# engine (planning, dispatch, schedules), so a run without disaggregation refuses it set (inert_fields).
ATTENTION_FUNCTION_FIELDS = ("backend",)  # the distca attention function's, with or without dispatch
DATA_PATH_FIELDS = ("pad_to_budget", "ranks_per_node")  # the data path's layouts, whatever the attention
# DistCAConfig.cost_table's value for "the measured table of this device, dtype, head shape and kernel".
COST_TABLE_AUTO = "auto"


@dataclass(frozen=True)
class DistCAConfig:
    """Knobs of the core-attention engine. Every rank must use an identical config."""

    tolerance: float | None = None
    """Balance target: planning stops once every server's attention cost (causal (query, key) pairs, or
    measured seconds with a ``cost_table``) is within (1 + tolerance) x the mean over servers. None (the
    default): ``PRICED_TOLERANCE`` (0.02) when communication is priced (``link_gib_per_s``, given or
    measured), else ``BALANCE_ONLY_TOLERANCE`` (0.1); see :attr:`balance_tolerance`. The priced planner
    takes a move only when it saves more than the transfer time it adds, so it can balance tighter; the
    balance-only planner prices nothing (why each value: README, "Communication-aware planning")."""

    shard_tokens: int = 128
    """Granularity of task splitting: a split point inside a document sits on a multiple of this
    many tokens (so shards are multiples of it except at document remainders). Varlen kernels lose
    efficiency on shards much shorter than ~128 tokens."""

    max_recv_bytes_per_server: int | None = None
    """Upper bound on the bytes one server may receive (Q plus KV) for work moved to it; moves that
    would exceed it are skipped. None: unbounded."""

    backend: str = "auto"
    """Kernel backend, one of KERNEL_BACKENDS: 'auto' picks the first usable one in that order (the CUDA
    kernels for float16/bfloat16 CUDA tensors, 'reference' elsewhere)."""

    max_planner_moves: int = 100_000
    """Safety bound on greedy moves per plan (planning stops early, never loops forever)."""

    cost_table: str | None = COST_TABLE_AUTO
    """What the planner balances. ``"auto"`` (the default): on CUDA tensors, measured kernel time: the
    table shipped in :mod:`hf_distca.cost_tables` for this GPU model, dtype, head shape and resolved kernel
    backend when there is one (1 x H200, bf16, 32/8 heads x 128, cudnn and torch_varlen), else one measured
    before the first engine call on the training GPUs (by :func:`hf_distca.engine.probe`, which
    :func:`hf_distca.enable_distca` runs; a reduced grid: 3-7 s on an H200 at 32/8 x 128; see
    :mod:`hf_distca.engine.cost_probe`; every rank plans with the ranks' mean); causal (query, key) pairs
    on the CPU, on one process without a shipped table, and with the reference kernel. A path: the measured
    CA-task time table in that JSON file (written by ``python -m hf_distca.calibrate --out PATH`` on the
    training GPUs with the model's head shape and dtype; every rank must read the same table; a file named
    auto is ``"./auto"``). None: causal pairs everywhere. Measured time prices short shards' lower kernel
    efficiency, which pairs cannot see."""

    link_gib_per_s: float | None = None
    """All-to-all bandwidth of one rank in GiB/s (sending and receiving at once) between nodes, or between
    every pair of ranks when ``ranks_per_node`` is None: ~21-23 with one 200 Gb/s NIC per GPU, ~250-300
    over H200 NVLink. Given, the planner prices every move: the compute time it saves on the busiest
    server against the transfer time it adds to the slowest rank of each all-to-all, and keeps the plan
    whose step critical path (slowest compute + exposed transfer, one layer forward+backward) is lowest,
    moving less work, or none, when moving it would cost more than it saves. None: communication is not
    priced (the balance-only plan)."""

    intra_node_gib_per_s: float | None = None
    """All-to-all bandwidth of one rank in GiB/s inside its node (with ``ranks_per_node``); None:
    transfers inside a node are not priced (NVLink is ~10x an inter-node NIC)."""

    ranks_per_node: int | None = None
    """Ranks [k n, (k + 1) n) of the group share node k (n = ranks_per_node): links between them run at
    ``intra_node_gib_per_s``, others at ``link_gib_per_s``. None: every pair at ``link_gib_per_s``."""

    kv_relay: bool = False
    """Send KV rows across nodes once per destination node instead of once per server that reads them
    (:mod:`hf_distca.planning.relay`): a holder sends the rows any server of another node reads, once, to
    that node's rank at its own position in its node (the relay), which forwards each server of its node
    the rows it reads; dK/dV come back the reverse way, summed at the relay. Needs ``ranks_per_node``
    and a group of whole nodes. Same results (up to the dK/dV sums: in another order, and in half
    precision rounded once more at the relay); the stages that carry
    KV run two all-to-all-v each instead of one. Pays off where long documents are cut over many
    nodes: in benchmarks/simulate.py at 512 GPUs it removes most exposed inter-node transfer. The planner
    counts a plan's bytes (``max_send_bytes_per_rank``, ``CorePlan.bytes_sent``) and, with
    ``link_gib_per_s``, prices its moves on the relayed route."""

    comm_overlap: float = 0.0
    """Fraction in [0, 1] of transfer time that overlap with compute hides, used to price moves: 0 (the
    engine without ping-pong) exposes all of it; 1 prices communication as free (the balance-only plan)."""

    layer_seconds_per_token: float | None = None
    """Seconds per token of one decoder layer's work besides core attention (norms, projections, MLP:
    forward, recompute and backward) on one rank; only with ``layer_ping_pong``. Given, the planner prices
    what layer-level ping-pong hides: a nano-batch's exchanges fly while the other nano-batch runs its
    layer work or its kernels, so each all-to-all phase is exposed only by ``max(0, its transfer time -
    the work it flies behind)``: this x the nano-batch's tokens per rank (a quarter in forward) or its mean
    core-attention seconds per server (the other nano-batch's work, taken equal to this one's: the split,
    :func:`hf_distca.data.nano.split_documents`, gives them about equal estimated cost); see
    :func:`hf_distca.planning.links.with_hiding_work`. On an H200 with a Llama-3-8B-shaped layer
    (hidden 4096, MLP 14336) ~4e-6 (the simulator's fit of the H200 measurements named in
    benchmarks/sim/costs.py; docs/architecture.md, "Benchmarks and the simulator"). None (the default): :func:`hf_distca.enable_distca` (which
    ``DistCACallback`` calls) derives it from the model's decoder layer, its weights at ``layer_tflops``
    (:func:`hf_distca.planning.links.layer_seconds_per_token`), when ``layer_ping_pong`` is on; left
    None (a model whose decoder layers it cannot find), every transfer is priced exposed (times
    ``1 - comm_overlap``)."""

    layer_tflops: float = 440.0
    """Throughput in TFLOP/s of a decoder layer's matmuls from which ``layer_seconds_per_token`` is derived
    when it is None: 440 is an H200 in bf16, the fit of our measurements of a Llama-3-8B-shaped layer
    (3.96 us per token); set it for other GPUs. The derivation counts forward, recompute and backward
    (activation checkpointing, every weight trained); without checkpointing, or with frozen weights (LoRA),
    the layer does less, transfers are then priced as better hidden than they are. Mixture-of-experts
    models get nothing derived (a warning): give ``layer_seconds_per_token`` there."""

    attention_tflops: float = 300.0
    """Forward+backward core-attention throughput in TFLOP/s that turns causal (query, key) pairs into
    seconds when communication is priced without a measured table (``cost_table`` None, or ``"auto"``
    where it resolves to causal pairs): 300 is FlashAttention-2 varlen on an
    H200 (259-332 measured for documents of 2K-64K tokens), i.e. 5.2e9 pairs per second at 32 query
    heads x 128 (14 x 32 x 128 FLOPs per pair forward+backward)."""

    max_send_bytes_per_rank: int | None = None
    """Upper bound on the bytes one rank sends in one forward call (query and KV rows it holds, to other
    servers, plus the outputs of the tasks it serves for others; the plan's ``bytes_sent``): moves that
    would take a rank above it are skipped. Bounds how far one long document's KV prefix fans out.
    None: unbounded."""

    measure_link: bool = False
    """With ``link_gib_per_s`` None: measure it once per process group before the first engine call
    (:func:`hf_distca.engine.probe`, which :func:`hf_distca.enable_distca` runs; a warm-up
    and a timed all-to-all of 8 MiB per rank to the ranks in other nodes, or all others, then an
    all-reduce so that every rank plans with the slowest rank's figure) and price communication with it.
    Plans then depend on a measurement: runs can differ in their plans, never in their results."""

    check_consistency: bool = True
    """Once per new micro-batch layout, all-gather a digest of every rank's inputs (pieces, tensor
    shapes and dtype, these config fields) and raise on every rank, naming what differs where, instead
    of hanging or planning differently. One small collective per micro-batch; must be equal on all ranks."""

    ping_pong: bool | None = False
    """Split each micro-batch's core attention into ping-pong parts whose exchanges run asynchronously
    while the other one's server kernel runs, in forward and backward (same results). True: always (on
    the CPU it runs the same schedule over gloo); None: on for CUDA tensors, off elsewhere; False (the
    default until its CUDA schedule has been checked over NCCL and measured on 2+ GPUs): never. Only calls
    whose plan moves rows between ranks are split."""

    ping_pong_split: str = "local_first"
    """How ping-pong splits each server's work, one of PING_PONG_SPLITS: 'local_first': the work that
    needs no exchange in two halves around the work that does (whose exchanges fly during those halves);
    'halves': two parts of equal work, each with its own exchanges (the first one's dispatch and
    the second one's return are not hidden)."""

    layer_ping_pong: bool = False
    """Split each micro-batch's documents into two nano-batches of about equal cost (whole documents,
    :func:`hf_distca.data.nano.split_documents`; each laid out and planned on its own) that run through
    the model as coroutines switching inside the attention function (:mod:`hf_distca.engine.interleave`):
    one nano-batch's exchanges fly while the other runs its projections, MLP and kernels, in forward and
    backward (same results). Applies to the data path of ``DistCACallback`` / ``DistCABatches`` and to
    :func:`hf_distca.nano_batch_loss`; inside each nano-batch the exchanges run around the other's work,
    so ``ping_pong`` does not apply there. A micro-batch with a single document runs whole."""

    prefetch_plans: bool = False
    """Plan each micro-batch in a background process while the one before it computes, so that planning
    leaves the training step's critical path (the planner is pure Python: seconds per step at hundreds of
    servers with priced links). The data path of ``DistCACallback`` / ``DistCABatches`` hands each coming
    micro-batch's layouts to :meth:`hf_distca.engine.prefetch.Prefetcher.prefetch_plans`, which plans them in every
    context the engine planned in so far (head shape, window, cost model); the engine takes those plans
    (the same plans: planning is deterministic) instead of planning. Costs one extra process per rank
    (started with the trainer, or the loader's iteration). Off: each micro-batch is planned at its first
    layer."""

    pad_to_budget: bool = False
    """How the data path of ``DistCACallback`` / ``DistCABatches`` lays out a micro-batch that runs whole.
    False (the default): at the fewest tokens per rank that hold its documents (``ceil(tokens / ranks)``,
    as layer-level ping-pong's nano-batches always are), so that no rank runs the projections and MLP over
    padding: on one H200 1.05-1.10x faster steps and up to 5 GiB less memory than padding to the budget
    (the global batching leaves 4-7% of it unfilled; benchmarks/results/layer_ping_pong_1xh200.md); the
    shapes then change from step to step (the cudnn kernel builds a plan per new bucketed shape, ~50 ms,
    until they recur). True: every micro-batch at the ``tokens_per_rank`` budget (the same shapes every
    step, e.g. for static-shape compilation)."""

    @property
    def balance_tolerance(self) -> float:
        """The tolerance the planner balances to: ``tolerance``, or for None ``PRICED_TOLERANCE`` when
        communication is priced (``link_gib_per_s`` set) and ``BALANCE_ONLY_TOLERANCE`` otherwise (both in
        :mod:`hf_distca.planning.options`, which resolves it)."""
        return self.planner_options().balance_tolerance

    def planner_options(self) -> PlannerOptions:
        """What the planner is told of this config: the fields of
        :class:`~hf_distca.planning.options.PlannerOptions`, which keep these fields' names."""
        return PlannerOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(PlannerOptions)})

    def plan_fields(self) -> tuple[tuple[str, object], ...]:
        """(name, value) of every field that can change the plan (all but ``RUN_ONLY_FIELDS``): what a
        cached plan is keyed by."""
        return tuple(
            (f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if f.name not in RUN_ONLY_FIELDS
        )

    def inert_fields(self, *, distca_attention: bool, disaggregate: bool) -> tuple[str, ...]:
        """The fields set away from their defaults that a run would not honour: without ``disaggregate``
        every field but the data path's (``DATA_PATH_FIELDS``) and, when the attention is the ``distca``
        function (``distca_attention``), its own (``ATTENTION_FUNCTION_FIELDS``)."""
        if disaggregate:
            return ()
        live = DATA_PATH_FIELDS + (ATTENTION_FUNCTION_FIELDS if distca_attention else ())
        return tuple(
            f.name
            for f in dataclasses.fields(self)
            if f.name not in live and getattr(self, f.name) != f.default
        )

    def __post_init__(self) -> None:
        if self.tolerance is not None and not (0.0 <= self.tolerance < 10.0):
            raise ValueError(f"DistCAConfig.tolerance must be in [0, 10) or None, got {self.tolerance!r}")
        if not isinstance(self.shard_tokens, int) or self.shard_tokens < 1:
            raise ValueError(f"DistCAConfig.shard_tokens must be a positive int, got {self.shard_tokens!r}")
        if self.max_recv_bytes_per_server is not None and self.max_recv_bytes_per_server <= 0:
            raise ValueError(
                "DistCAConfig.max_recv_bytes_per_server must be positive or None, "
                f"got {self.max_recv_bytes_per_server!r}"
            )
        if self.backend not in KERNEL_BACKENDS:
            raise ValueError(f"DistCAConfig.backend must be one of {KERNEL_BACKENDS}, got {self.backend!r}")
        if self.cost_table is not None and self.cost_table != COST_TABLE_AUTO:
            if not isinstance(self.cost_table, str) or not self.cost_table:
                raise ValueError(
                    f"DistCAConfig.cost_table must be a path (str), {COST_TABLE_AUTO!r} or None, "
                    f"got {self.cost_table!r}"
                )
            if not os.path.isfile(self.cost_table):
                raise ValueError(
                    f"DistCAConfig.cost_table={self.cost_table!r} is not a file; write it with "
                    f"python -m hf_distca.calibrate --out {self.cost_table}"
                )
            cost_model_from_config(self)  # a malformed table raises here, naming the file
        for name in ("link_gib_per_s", "intra_node_gib_per_s"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int | float) and value > 0):
                raise ValueError(
                    f"DistCAConfig.{name} must be a positive number of GiB/s or None, got {value!r}"
                )
        if self.ranks_per_node is not None and (
            not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1
        ):
            raise ValueError(
                f"DistCAConfig.ranks_per_node must be a positive int or None, got {self.ranks_per_node!r}"
            )
        if not isinstance(self.kv_relay, bool):
            raise ValueError(f"DistCAConfig.kv_relay must be True or False, got {self.kv_relay!r}")
        if self.kv_relay and self.ranks_per_node is None:
            raise ValueError(
                "DistCAConfig.kv_relay relays KV rows through one rank of each node: set ranks_per_node to "
                "the ranks of one node (e.g. 8), or kv_relay=False"
            )
        if not (0.0 <= self.comm_overlap <= 1.0):
            raise ValueError(f"DistCAConfig.comm_overlap must be in [0, 1], got {self.comm_overlap!r}")
        if self.layer_seconds_per_token is not None:
            if not (
                isinstance(self.layer_seconds_per_token, int | float) and self.layer_seconds_per_token >= 0
            ):
                raise ValueError(
                    "DistCAConfig.layer_seconds_per_token must be a number of seconds >= 0 or None, "
                    f"got {self.layer_seconds_per_token!r}"
                )
            if not self.layer_ping_pong:
                raise ValueError(
                    "DistCAConfig.layer_seconds_per_token prices the exchanges that layer-level ping-pong hides: "
                    "set layer_ping_pong=True with it, or leave it None"
                )
        for name in ("attention_tflops", "layer_tflops"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0.0 < value < float("inf")):
                raise ValueError(f"DistCAConfig.{name} must be a positive finite number, got {value!r}")
        if self.max_send_bytes_per_rank is not None and self.max_send_bytes_per_rank <= 0:
            raise ValueError(
                f"DistCAConfig.max_send_bytes_per_rank must be positive or None, got {self.max_send_bytes_per_rank!r}"
            )
        if self.max_planner_moves < 0:
            raise ValueError(f"DistCAConfig.max_planner_moves must be >= 0, got {self.max_planner_moves!r}")
        if not (self.ping_pong is None or isinstance(self.ping_pong, bool)):
            raise ValueError(
                f"DistCAConfig.ping_pong must be True, False or None (auto), got {self.ping_pong!r}"
            )
        if not isinstance(self.layer_ping_pong, bool):
            raise ValueError(
                f"DistCAConfig.layer_ping_pong must be True or False, got {self.layer_ping_pong!r}"
            )
        if not isinstance(self.pad_to_budget, bool):
            raise ValueError(f"DistCAConfig.pad_to_budget must be True or False, got {self.pad_to_budget!r}")
        if not isinstance(self.prefetch_plans, bool):
            raise ValueError(
                f"DistCAConfig.prefetch_plans must be True or False, got {self.prefetch_plans!r}"
            )
        if self.ping_pong_split not in PING_PONG_SPLITS:
            raise ValueError(
                f"DistCAConfig.ping_pong_split must be one of {PING_PONG_SPLITS}, got {self.ping_pong_split!r}"
            )


def cost_model_from_config(
    config: DistCAConfig, window: int | None = None, auto_table: MeasuredCost | None = None
) -> CausalPairsCost | MeasuredCost:
    """The cost model ``config`` asks for (:mod:`hf_distca.planning.cost`), for a layer with this sliding
    ``window`` (None: full causal).

    ``config.cost_table`` None: :class:`~hf_distca.planning.cost.CausalPairsCost`; a path:
    :class:`~hf_distca.planning.cost.MeasuredCost` of that table, loaded once per file version (path,
    modification time, size) and shared by later calls; ``"auto"``: ``auto_table``, the table the engine
    resolved for the device, dtype, head shape and kernel (:mod:`hf_distca.engine.cost_probe`), or causal
    pairs when it is None (CPU tensors, no engine)."""
    path = config.cost_table
    if path == COST_TABLE_AUTO:
        return (_PAIRS if auto_table is None else auto_table).with_window(window)
    if path is None:
        return _PAIRS.with_window(window)
    stat = os.stat(path)
    return _load_table(os.path.abspath(path), stat.st_mtime_ns, stat.st_size).with_window(window)


_PAIRS = CausalPairsCost()


@functools.lru_cache(maxsize=8)
def _load_table(path: str, mtime_ns: int, size: int) -> MeasuredCost:
    return MeasuredCost.from_json(path)
