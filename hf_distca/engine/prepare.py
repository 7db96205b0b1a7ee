"""Stage "prepare": the plan of one micro-batch and this rank's index tensors, agreed across ranks.

Every rank plans from the same all-gathered pieces and gets the same plan (nothing is broadcast).
Plans are cached by content; index tensors are cached per device on the prepared object, so the layers
of one micro-batch plan once. Agreement is checked by :mod:`hf_distca.engine.consistency` at points all
ranks agree on even when their inputs differ:

- ``all_pieces`` given (the Transformers path: the data path builds one layout object per micro-batch
  on every rank, and every layer and recompute reuses it): on the first call with each new
  ``all_pieces`` object (by identity), one all-gather of the check vector;
- ``all_pieces`` not given: the engine all-gathers the pieces on every call anyway, and the check vector
  travels in the same all-gather as the piece counts.
A new plan (a layout and window first planned, in the Transformers path at the first attention call of
a micro-batch) is then compared across the ranks: one all-gather of its digest
(:func:`compare_plan`), every rank raising the same :class:`~hf_distca.engine.consistency.PlanMismatchError`
when they differ. A cache hit on one rank and a miss on another therefore never changes which collectives
run: both are decided by what every rank holds alike (the layout object, the plan's inputs), never by
a rank's caches. The caches
live in the :class:`~hf_distca.engine.state.EngineState` (``state``); the probes' results (measured link,
kernel-cost table) are read from it, never measured here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hf_distca import metrics
from hf_distca.comm import all_gather_padded, all_gather_rows, collective_device, group_rank_world
from hf_distca.config import DistCAConfig, cost_model_from_config
from hf_distca.engine.consistency import (
    CallerInputError,
    LocalInputs,
    Pieces,
    check_vector,
    describe_inputs,
    digest64,
    raise_on_disagreement,
    raise_on_plan_mismatch,
)
from hf_distca.engine.cost_probe import auto_cost_table
from hf_distca.engine.link_probe import with_measured_link
from hf_distca.engine.prefetch import PlanContext, pieces_digest
from hf_distca.engine.state import (
    CHECKED_LAYOUTS,
    COMPARED_PLANS,
    PLAN_CACHE_SIZE,
    CheckedLayout,
    EngineState,
    engine_state,
    group_key,
)
from hf_distca.kernels import VarlenOffsets, host_to_device
from hf_distca.kernels.common import int32_offsets
from hf_distca.planning import (
    CorePlan,
    DispatchIndex,
    MeasuredCost,
    build_dispatch_index,
    forward_flops_per_pair,
)
from hf_distca.planning.relay import with_relay


@dataclass(frozen=True)
class DeviceIndex:
    """The index arrays of a :class:`~hf_distca.planning.DispatchIndex` as int64 tensors on one device."""

    send_q_rows: torch.Tensor
    send_kv_rows: torch.Tensor
    kernel_q_index: torch.Tensor
    kernel_kv_index: torch.Tensor
    out_send_index: torch.Tensor
    out_gather: torch.Tensor
    relay_send_rows: torch.Tensor | None


@dataclass
class PreparedAttention:
    """Everything the other stages need for one micro-batch on this rank (shared by all its layers)."""

    plan: CorePlan
    index: DispatchIndex
    q_heads: int
    kv_heads: int
    head_dim: int
    cu_seqlens_q: torch.Tensor
    """(tasks + 1,) int32 on the CPU: the server kernel's query offsets in ROWS (kernels read them on the host;
    :func:`~hf_distca.kernels.common.int32_offsets` refuses, never wraps, rows past 2**31 - 1)."""
    cu_seqlens_k: torch.Tensor
    flops_before: list[float]
    """Per server, forward core-attention FLOPs of one call without balancing (each rank its own pieces)."""
    flops_after: list[float]
    """Per server, forward FLOPs of one call as planned."""
    common_key: tuple = ()
    """The plan's cache key without this rank's number (:meth:`~hf_distca.engine.prefetch.PlanContext.common_key`)."""
    part_splits: dict[tuple[int, str], Any] = field(default_factory=dict)
    """Its ping-pong parts by (shard_tokens, split), cached by :func:`hf_distca.engine.ping_pong.ping_pong_parts`."""
    _on_device: dict[str, DeviceIndex] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.index.rank

    def kernel_seqs(self) -> VarlenOffsets:
        """The offsets of the server kernel's packed sequences."""
        return VarlenOffsets(
            self.cu_seqlens_q, self.cu_seqlens_k, self.index.max_seqlen_q, self.index.max_seqlen_k
        )

    @property
    def window(self) -> int | None:
        """The layer's sliding window the plan (and so the server kernel) follows; None: full causal."""
        return self.plan.window

    @property
    def world(self) -> int:
        return self.index.world_size

    @property
    def num_local(self) -> int:
        return self.index.num_local

    @property
    def communicates(self) -> bool:
        """Whether any rank sends anything under this plan (all ranks agree: the plan is shared)."""
        return self.world > 1 and any(self.plan.bytes_sent)

    def device_index(self, device: torch.device) -> DeviceIndex:
        key = str(device)
        if key not in self._on_device:
            ix = self.index

            def as_t(a: np.ndarray) -> torch.Tensor:  # through pinned memory on CUDA: no host wait
                return host_to_device(torch.as_tensor(np.ascontiguousarray(a), dtype=torch.long), device)

            self._on_device[key] = DeviceIndex(
                send_q_rows=as_t(ix.send_q_rows),
                send_kv_rows=as_t(ix.send_kv_rows),
                kernel_q_index=as_t(ix.kernel_q_index),
                kernel_kv_index=as_t(ix.kernel_kv_index),
                out_send_index=as_t(ix.out_send_index),
                out_gather=as_t(ix.out_gather),
                relay_send_rows=None if ix.relay is None else as_t(ix.relay.send_rows),
            )
        return self._on_device[key]


def prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pieces: Sequence[Sequence[int]],
    *,
    group: Any = None,
    config: DistCAConfig,
    all_pieces: Sequence[Sequence[Sequence[int]]] | None = None,
    window: int | None = None,
    state: EngineState | None = None,
    caller_error: CallerInputError | None = None,
) -> PreparedAttention:
    """The plan and index tensors of this call (see the module docstring for when ranks are checked);
    ``window``: the layer's sliding window (plans are cached per window: local and global layers of one
    micro-batch plan once each); ``state``: the engine state caching them (None: the process's);
    ``caller_error``: what the caller found wrong with this rank's call, raised on every rank together.

    Collective on ``group`` when the inputs are new (see above); raises on every rank of the group
    together when any rank's input is malformed, the ranks disagree, or their plans differ."""
    state = state if state is not None else engine_state()
    rank, world = group_rank_world(group)
    if world == 1:
        info = describe_inputs(q, k, v, pieces, all_pieces, 0, 1, caller_error)
        info.raise_if_failed()
        everyone = info.all_pieces if info.all_pieces is not None else [info.pieces]
        digest = pieces_digest(everyone)
    elif all_pieces is None:
        info = describe_inputs(q, k, v, pieces, None, rank, world, caller_error)
        everyone = _gather_pieces(info, config, group, q.device)
        digest = pieces_digest(everyone)
    else:
        seen = _checked(state, all_pieces, group_key(group))
        if seen is not None and caller_error is not None:
            # the caller's errors are properties of the forward (its batch, its mask), the same for every
            # layer, and the layout's first call checked them on every rank together: a layout object
            # reused for another forward is the caller's bug (pass a new one per micro-batch)
            raise caller_error
        if seen is None:
            info = describe_inputs(q, k, v, pieces, all_pieces, rank, world, caller_error)
            if config.check_consistency:
                metrics.record_check()
                vectors = all_gather_rows(check_vector(info, config), group, q.device)
                raise_on_disagreement(vectors, info, config, compare_inputs=True, compare_all_pieces=True)
            info.raise_if_failed()
            seen = CheckedLayout(all_pieces, group_key(group), info.all_pieces, info.all_pieces_digest)
            state.checked_layouts.append(seen)
            del state.checked_layouts[:-CHECKED_LAYOUTS]
        everyone, digest = seen.all_pieces, seen.digest
    if world > 1:
        config = with_measured_link(config, group, state)  # the link probe's figure (probed before)
    auto_table = auto_cost_table(config, group, q, k, state)  # cost_table="auto": the probe's table
    prepared = _planned(everyone, digest, rank, q, k, config, window, auto_table, state=state)
    if world > 1 and config.check_consistency:
        compare_plan(prepared, group, q.device, state)
    # the first call with a layout checked (every rank together) that its rows are q's; a later call with
    # the same object and other rows reuses one layout for two micro-batches, a caller's bug this check
    # names (it can be rank-local: only a collective per call could decide it together, which the layers
    # of a micro-batch do not pay for; the data path builds one layout per micro-batch, so never here)
    if prepared.num_local != q.shape[0]:
        raise ValueError(
            f"rank {rank}: q holds {q.shape[0]} rows but this micro-batch's pieces give it {prepared.num_local}; "
            "pass a new all_pieces object for each micro-batch"
        )
    return prepared


def compare_plan(prepared: PreparedAttention, group: Any, device: torch.device, state: EngineState) -> None:
    """Compare ``prepared``'s plan with every rank's (one all-gather of its digest) the first time the
    ranks of ``group`` meet its plan key; raise the same error on every rank when they differ.

    Here rather than before the step: a plan depends on the layer's heads, dtype, window and the probed
    cost model, which only the attention call knows, and every rank of the group reaches this point
    for the same layers in the same order. Whether a key was met is decided by :attr:`EngineState.compared_plans`
    (kept by ``reset``), never by the plan cache, so a cache cleared on one rank changes no collective."""
    key = (group_key(group), *prepared.common_key)
    if key in state.compared_plans:
        state.compared_plans.move_to_end(key)
        return
    digests = [row[0] for row in all_gather_rows([digest64(prepared.plan.digest())], group, device)]
    raise_on_plan_mismatch(digests)  # the same digests on every rank: the same decision, the same text
    state.compared_plans[key] = None
    while len(state.compared_plans) > COMPARED_PLANS:
        state.compared_plans.popitem(last=False)


def _checked(state: EngineState, all_pieces: Any, group: tuple) -> CheckedLayout | None:
    """The check of ``all_pieces`` (this very object) on ``group``, made the latest; None if none."""
    for i, seen in enumerate(state.checked_layouts):
        if seen.obj is all_pieces and seen.group == group:
            state.checked_layouts.append(state.checked_layouts.pop(i))
            return seen
    return None


def _gather_pieces(info: LocalInputs, config: DistCAConfig, group: Any, device: torch.device) -> list[Pieces]:
    """All ranks' pieces: one all-gather of [piece count | check vector], then one of the padded pieces."""
    if config.check_consistency:
        metrics.record_check()
    rows = all_gather_rows([len(info.pieces), *check_vector(info, config)], group, device)
    raise_on_disagreement(
        [r[1:] for r in rows], info, config, compare_inputs=config.check_consistency, compare_all_pieces=False
    )
    info.raise_if_failed()
    counts = [r[0] for r in rows]
    mine = torch.tensor(info.pieces, dtype=torch.long).reshape(-1, 3)  # (pieces, 3)
    everyone = all_gather_padded(mine, counts, group, collective_device(group, device))
    return [[tuple(p) for p in t.cpu().tolist()] for t in everyone]


def _planned(
    all_pieces: list[Pieces],
    digest: int,
    rank: int,
    q: torch.Tensor,
    k: torch.Tensor,
    config: DistCAConfig,
    window: int | None = None,
    auto_table: MeasuredCost | None = None,
    *,
    state: EngineState | None = None,
) -> PreparedAttention:
    state = state if state is not None else engine_state()
    q_heads, head_dim, kv_heads = q.shape[1], q.shape[2], k.shape[1]
    context = PlanContext(
        rank=rank,
        world=len(all_pieces),
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        elem=q.element_size(),
        config=config,
        cost_model=cost_model_from_config(config, window, auto_table),
        window=window,
    )
    key = context.key(digest)
    hit = state.plans.get(key)
    if hit is not None:
        state.plans.move_to_end(key)
        return hit
    state.prefetcher.remember(context)
    t0 = time.perf_counter()  # what this thread spends: waiting for a prefetched plan, or planning
    plan = state.prefetcher.take(key)
    prefetched = plan is not None
    if plan is None:
        plan = context.plan(all_pieces)
    index = relayed_index(plan, rank, config)
    metrics.record_plan(time.perf_counter() - t0, prefetched=prefetched)
    flops_per_pair = forward_flops_per_pair(q_heads, head_dim)
    prepared = PreparedAttention(
        plan=plan,
        index=index,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        cu_seqlens_q=int32_offsets(index.cu_seqlens_q),
        cu_seqlens_k=int32_offsets(index.cu_seqlens_k),
        flops_before=[x * flops_per_pair for x in plan.pairs_before],
        flops_after=[x * flops_per_pair for x in plan.pairs_after],
        common_key=context.common_key(digest),
    )
    state.plans[key] = prepared
    if len(state.plans) > PLAN_CACHE_SIZE:
        state.plans.popitem(last=False)
    return prepared


def relayed_index(plan: CorePlan, rank: int, config: DistCAConfig) -> DispatchIndex:
    """``rank``'s index of ``plan``, its KV through the relay when ``config.kv_relay`` asks for it."""
    index = build_dispatch_index(plan, rank)
    return with_relay(plan, index, config.ranks_per_node) if config.kv_relay else index
