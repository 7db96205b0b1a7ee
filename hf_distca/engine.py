"""core_attention: per-document causal attention of a packed micro-batch, balanced across ranks.

Per call: (1) the plan for this micro-batch's pieces (made once, cached, reused by every layer);
(2) one all-to-all-v sending Q shards and the KV prefixes they need to their servers; (3) one fused
varlen kernel per server over all its CA-tasks; (4) one all-to-all-v bringing outputs home. Autograd
mirrors it: dout goes to the servers, dq/dk/dv come back (dk/dv summed over every task that used
them, by index_select's backward).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from hf_distca import metrics
from hf_distca.comm import all_to_all_v
from hf_distca.config import DistCAConfig
from hf_distca.kernels import varlen_attention
from hf_distca.planning import CorePlan, RankLayout, build_rank_layout, plan_core_attention
from hf_distca.planning.cost import causal_pairs

_PLAN_CACHE_SIZE = 8
_plan_cache: OrderedDict[tuple, _Prepared] = OrderedDict()


@dataclass
class _Prepared:
    plan: CorePlan
    layout: RankLayout
    flops_per_pair_unit: float  # pairs -> forward FLOPs
    pairs_before: list[float]
    pairs_after: list[float]
    device_index: dict = field(default_factory=dict)

    def indices(self, device: torch.device) -> dict[str, torch.Tensor]:
        key = str(device)
        if key not in self.device_index:
            lay = self.layout
            as_t = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.long, device=device)  # noqa: E731
            self.device_index[key] = {
                "send_q_rows": as_t(lay.send_q_rows),
                "send_kv_rows": as_t(lay.send_kv_rows),
                "kernel_q_index": as_t(lay.kernel_q_index),
                "kernel_kv_index": as_t(lay.kernel_kv_index),
                "cu_seqlens_q": torch.as_tensor(lay.cu_seqlens_q, dtype=torch.int32, device=device),
                "cu_seqlens_k": torch.as_tensor(lay.cu_seqlens_k, dtype=torch.int32, device=device),
                "out_send_index": as_t(lay.out_send_index),
                "out_gather": as_t(lay.out_gather),
            }
        return self.device_index[key]


def _world(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("a process group was passed but torch.distributed is not initialized")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _check_pieces(pieces: Sequence[Sequence[int]], num_tokens: int) -> list[tuple[int, int, int]]:
    out = []
    for p in pieces:
        if len(p) != 3:
            raise ValueError(f"a piece is (doc_id, doc_start, length), got {tuple(p)!r}")
        out.append((int(p[0]), int(p[1]), int(p[2])))
    total = sum(p[2] for p in out)
    if total != num_tokens:
        raise ValueError(
            f"pieces cover {total} tokens but q holds {num_tokens}; pieces must describe every local token "
            "in local order"
        )
    return out


def gather_pieces(
    pieces: list[tuple[int, int, int]], group, device: torch.device, *, ok: bool = True
) -> list[list[tuple]]:
    """All ranks' pieces, via two small all-gathers (counts, then padded pieces).

    ``ok=False``: this rank's pieces are invalid; it still takes part in the first all-gather so that
    every rank raises ValueError together instead of the others waiting forever."""
    rank, world = _world(group)
    if world == 1:
        return [pieces]
    backend = dist.get_backend(group)
    if backend == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    elif backend == "gloo":
        device = torch.device("cpu")
    # Fix (hang): the count all-gather also carries a validity flag, see `ok` above.
    count = torch.tensor([len(pieces), int(ok)], dtype=torch.long, device=device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    bad = [r for r, c in enumerate(counts) if int(c[1].item()) == 0]
    if bad:
        raise ValueError(
            f"rank(s) {bad} passed pieces that do not describe their local tokens (see the error on those ranks)"
        )
    n_max = max(int(c[0].item()) for c in counts)
    mine = torch.full((max(n_max, 1), 3), -1, dtype=torch.long, device=device)
    if pieces:
        mine[: len(pieces)] = torch.tensor(pieces, dtype=torch.long, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    return [
        [tuple(row) for row in t[: int(c[0].item())].cpu().tolist()]
        for t, c in zip(everyone, counts, strict=True)
    ]


def _prepare(
    all_pieces: list[list[tuple]],
    rank: int,
    q_row_bytes: int,
    kv_row_bytes: int,
    flops_per_pair: float,
    config,
) -> _Prepared:
    key_src = repr((all_pieces, q_row_bytes, kv_row_bytes, config)).encode()
    key = (hashlib.sha1(key_src).hexdigest(), rank)
    hit = _plan_cache.get(key)
    if hit is not None:
        _plan_cache.move_to_end(key)
        return hit
    t0 = time.perf_counter()
    plan = plan_core_attention(all_pieces, q_row_bytes=q_row_bytes, kv_row_bytes=kv_row_bytes, config=config)
    layout = build_rank_layout(plan, rank)
    metrics.record_plan(time.perf_counter() - t0)
    pairs_after = [float(sum(causal_pairs(t.q_start, t.q_end) for t in ts)) for ts in plan.tasks]
    pairs_before = [0.0] * plan.world_size
    for doc in plan.index.doc_ids:
        for h in plan.index.holdings[doc]:
            pairs_before[h.rank] += causal_pairs(h.doc_start, h.doc_end)
    prepared = _Prepared(plan, layout, flops_per_pair, pairs_before, pairs_after)
    _plan_cache[key] = prepared
    if len(_plan_cache) > _PLAN_CACHE_SIZE:
        _plan_cache.popitem(last=False)
    return prepared


def _verify_plan(plan: CorePlan, group) -> None:
    digest = plan.digest()
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, digest, group=group)
    if len(set(everyone)) != 1:
        raise RuntimeError(f"ranks computed different plans (digests {everyone}); inputs are not identical")


def core_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pieces: Sequence[Sequence[int]],
    *,
    group=None,
    config: DistCAConfig | None = None,
    scale: float | None = None,
    all_pieces: list[list[tuple]] | None = None,
) -> torch.Tensor:
    """Causal per-document attention of this rank's queries, computed by balanced attention servers.

    q: (T_local, H_q, D); k, v: (T_local, H_kv, D), this rank's tokens in local order.
    pieces: this rank's ``(doc_id, doc_start, length)`` runs in local order (doc ids are global).
    group: the attention-server process group (None: the world when torch.distributed is
    initialized, else a single process). Every rank of the group must call collectively.
    all_pieces: every rank's pieces, when the caller already gathered them (skips one all-gather).
    Returns (T_local, H_q, D), differentiable w.r.t. q, k and v.
    """
    config = config or DistCAConfig()
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"core_attention expects (T, H, D) tensors, got {tuple(q.shape)}, {tuple(k.shape)}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"q, k, v hold different token counts: {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    rank, world = _world(group)
    try:
        mine = _check_pieces(pieces, q.shape[0])
    except (TypeError, ValueError) as err:
        if world == 1 or all_pieces is not None:
            raise
        # Fix (hang): raising here alone left every other rank blocked in gather_pieces' all-gather.
        # Join it with a failure flag so that all ranks raise; this rank raises its own detailed error.
        with contextlib.suppress(ValueError):
            gather_pieces([], group, q.device, ok=False)
        raise err
    if all_pieces is None:
        all_pieces = gather_pieces(mine, group, q.device)
    elif len(all_pieces) != world or [tuple(p) for p in all_pieces[rank]] != mine:
        raise ValueError(
            f"all_pieces must list the pieces of all {world} ranks of the group, with this rank's equal to `pieces`"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    elem = q.element_size()
    prepared = _prepare(
        all_pieces,
        rank,
        q_row_bytes=num_heads * head_dim * elem,
        kv_row_bytes=2 * k.shape[1] * head_dim * elem,
        flops_per_pair=4.0 * num_heads * head_dim,
        config=config,
    )
    if config.verify_plan and world > 1:
        _verify_plan(prepared.plan, group)
    metrics.record_call(
        [p * prepared.flops_per_pair_unit for p in prepared.pairs_before],
        [p * prepared.flops_per_pair_unit for p in prepared.pairs_after],
    )
    return _run(q, k, v, prepared, group, world, config, scale)


def _run(q, k, v, prepared: _Prepared, group, world: int, config: DistCAConfig, scale) -> torch.Tensor:
    lay = prepared.layout
    idx = prepared.indices(q.device)
    _, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    communicates = world > 1 and any(prepared.plan.bytes_sent)

    if communicates:
        # ---- dispatch: per destination [Q rows | K rows | V rows], flattened into one buffer
        q_send = q.index_select(0, idx["send_q_rows"])  # (Nq, Hq, D)
        k_send = k.index_select(0, idx["send_kv_rows"])  # (Nkv, Hkv, D)
        v_send = v.index_select(0, idx["send_kv_rows"])  # (Nkv, Hkv, D)
        parts = []
        for qs, ks, vs in zip(
            q_send.split(lay.send_q_counts),
            k_send.split(lay.send_kv_counts),
            v_send.split(lay.send_kv_counts),
            strict=True,
        ):
            parts += [qs.reshape(-1), ks.reshape(-1), vs.reshape(-1)]
        q_elems, kv_elems = num_heads * head_dim, kv_heads * head_dim  # per row
        send_splits = [
            nq * q_elems + 2 * nkv * kv_elems for nq, nkv in zip(lay.send_q_counts, lay.send_kv_counts)
        ]
        recv_splits = [
            nq * q_elems + 2 * nkv * kv_elems for nq, nkv in zip(lay.recv_q_counts, lay.recv_kv_counts)
        ]
        recv = all_to_all_v(torch.cat(parts), send_splits, recv_splits, group)
        rq, rk, rv = [q], [k], [v]
        for chunk, nq, nkv in zip(
            recv.split(recv_splits), lay.recv_q_counts, lay.recv_kv_counts, strict=True
        ):
            a, b = nq * q_elems, nkv * kv_elems
            rq.append(chunk[:a].view(nq, num_heads, head_dim))  # (nq, Hq, D)
            rk.append(chunk[a : a + b].view(nkv, kv_heads, head_dim))  # (nkv, Hkv, D)
            rv.append(chunk[a + b :].view(nkv, kv_heads, head_dim))  # (nkv, Hkv, D)
        q_pool, k_pool, v_pool = torch.cat(rq), torch.cat(rk), torch.cat(rv)
    else:
        q_pool, k_pool, v_pool = q, k, v

    # ---- one fused kernel over every CA-task this server runs
    q_kernel = q_pool.index_select(0, idx["kernel_q_index"])  # (Tq, Hq, D)
    k_kernel = k_pool.index_select(0, idx["kernel_kv_index"])  # (Tk, Hkv, D)
    v_kernel = v_pool.index_select(0, idx["kernel_kv_index"])  # (Tk, Hkv, D)
    if q_kernel.shape[0]:
        out_kernel = varlen_attention(
            q_kernel,
            k_kernel,
            v_kernel,
            idx["cu_seqlens_q"],
            idx["cu_seqlens_k"],
            lay.max_seqlen_q,
            lay.max_seqlen_k,
            scale=scale,
            backend=config.backend,
        )
    else:
        # (0, Hq, D), keeps the graph connected. Fix: k and v too (their rows are empty here), else a
        # server with no task and no exchange returned grad None for k/v instead of zeros.
        out_kernel = q_kernel * 0 + (k_kernel.sum() + v_kernel.sum()) * 0

    # ---- return outputs to their query owners
    if communicates:
        out_send = out_kernel.index_select(0, idx["out_send_index"]).reshape(-1)
        send_splits = [n * num_heads * head_dim for n in lay.out_send_counts]
        recv_splits = [n * num_heads * head_dim for n in lay.out_recv_counts]
        out_recv = all_to_all_v(out_send, send_splits, recv_splits, group)
        out_pool = torch.cat([out_kernel, out_recv.view(-1, num_heads, head_dim)])  # (Tq + R, Hq, D)
    else:
        out_pool = out_kernel
    return out_pool.index_select(0, idx["out_gather"])  # (T_local, Hq, D)


def clear_plan_cache() -> None:
    _plan_cache.clear()
