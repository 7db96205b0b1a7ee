"""linear_attention: causal linear attention of this rank's pieces, with documents cut across ranks.

Three stages, all differentiable:
1. local: the recurrence over every local piece from a zero state (one varlen kernel call), keeping the
   final states of the pieces that continue on another piece, and the transitions of those pieces;
2. scan: the states entering the pieces that continue a document (:func:`scan_states`: All-Scan,
   serial hand-off or all-gather);
3. correction: each continuing piece's outputs get the contribution of the state it enters with.

The result equals the recurrence run on the uncut documents (tests: ``tests/test_all_scan*.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hf_distca.comm import group_rank_world
from hf_distca.linear.config import LinearSPConfig
from hf_distca.linear.ops.all_scan import scan_states
from hf_distca.linear.ops.fla_backend import fla_kind
from hf_distca.linear.ops.local import (
    piece_transitions,
    recurrence,
    resolve_linear_backend,
    state_contribution,
)
from hf_distca.linear.ops.recurrence import check_recurrence_inputs, transition_kind
from hf_distca.linear.ops.scan_plan import build_scan_plan

__all__ = ["linear_attention"]

_DEFAULT = LinearSPConfig()


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pieces: Sequence[Sequence[int]],
    *,
    log_decay: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float = 1.0,
    group=None,
    all_pieces: Sequence[Sequence[Sequence[int]]] | None = None,
    config: LinearSPConfig = _DEFAULT,
) -> torch.Tensor:
    """Linear attention (see :mod:`hf_distca.linear.ops.recurrence` for the recurrences) of this rank's
    tokens, each document restarting from a zero state, documents continuing across ranks.

    q, k: (T, H, K); v: (T, H, V); log_decay: None, (H,), (T, H) or (T, H, K); beta: None or (T, H)
    (delta rule); ``pieces``: this rank's (doc_id, doc_start, length) runs in local order;
    ``all_pieces``: every rank's pieces (index = rank in ``group``; identical on all ranks; may be
    omitted on a single process). All ranks of ``group`` call this together. Returns o (T, H, V).
    """
    check_recurrence_inputs(q, k, v, log_decay, beta)
    local = [tuple(int(x) for x in p) for p in pieces]
    if sum(n for _, _, n in local) != q.shape[0]:
        raise ValueError(
            f"the pieces cover {sum(n for _, _, n in local)} tokens but q holds {q.shape[0]}; pieces must list "
            "this rank's tokens in local order"
        )
    rank, world = group_rank_world(group)
    if all_pieces is None:
        if world != 1:
            raise ValueError(
                f"all_pieces (every rank's pieces) is required with {world} ranks; the layout of "
                "hf_distca.data gives it (distca_layout.all_pieces)"
            )
        all_pieces = [local]
    if len(all_pieces) != world:
        raise ValueError(f"all_pieces lists {len(all_pieces)} ranks but the group has {world}")
    if [tuple(int(x) for x in p) for p in all_pieces[rank]] != local:
        raise ValueError(f"pieces differ from all_pieces[{rank}]: every rank must pass the same layout")
    plan = build_scan_plan(all_pieces, rank)
    backend = resolve_linear_backend(config.backend, q.device, kind=fla_kind(log_decay, beta), dtype=q.dtype)

    nonempty = [i for i, (_, _, n) in enumerate(local) if n > 0]
    cu = [0]
    for i in nonempty:
        cu.append(cu[-1] + local[i][2])
    o_local, finals = recurrence(
        q,
        k,
        v,
        cu_seqlens=cu,
        log_decay=log_decay,
        beta=beta,
        scale=scale,
        output_final_state=bool(plan.out_pieces),
        backend=backend,
    )
    if not plan.has_edges:  # no document is cut: the same decision on every rank
        return o_local

    h, kd, vd = q.shape[1], q.shape[2], v.shape[2]
    state_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    if plan.out_pieces:
        seq_of_piece = {piece: seq for seq, piece in enumerate(nonempty)}
        out_rows = torch.tensor([seq_of_piece[p] for p in plan.out_pieces], device=q.device)
        local_states = finals.index_select(0, out_rows).to(state_dtype)  # (n_out, H, K, V)
    else:
        local_states = q.new_zeros((0, h, kd, vd), dtype=state_dtype)
    transitions = piece_transitions(
        q, k, plan.out_runs, log_decay=log_decay, beta=beta, state_dtype=state_dtype, backend=backend
    )
    kind = transition_kind(log_decay, beta)
    entering, token = scan_states(
        transitions,
        local_states,
        plan,
        kind=kind,
        method=config.scan,
        num_blocks=config.num_blocks,
        group=group,
        anchor=o_local,
    )
    out = o_local + token.to(o_local.dtype)  # every rank's scan takes part in backward
    if plan.in_pieces:
        extra = state_contribution(
            q, k, plan.in_runs, entering, log_decay=log_decay, beta=beta, scale=scale, backend=backend
        )  # (rows of the in pieces, H, V)
        rows = torch.cat([torch.arange(s, s + n, device=q.device) for s, n in plan.in_runs])
        out = out.index_add(0, rows, extra.to(out.dtype))
    return out
