"""The linear-attention recurrences as a plain per-token loop: the CPU backend and the float64 oracle.

Per head, the state S is a (K, V) matrix. Token t updates it with its transition and its key/value,
then reads it with its query (the output includes the token itself):

- diagonal decay (linear attention, lightning attention, RetNet, GLA, Mamba-2-like gates)::

      S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T          o_t = scale * S_t^T q_t

  with ``g`` a per-head scalar log decay (constant (H,) or per token (T, H)) or a per key dimension
  log decay (T, H, K); no decay when ``log_decay`` is None.
- delta rule (DeltaNet, gated DeltaNet, Kimi delta attention): a dense (K, K) transition::

      S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T

Both are linear in (S_0, v) for fixed (q, k, g, beta), which the sequence-parallel path relies on: the
output of a piece is its output from a zero state plus the contribution of the state it starts from.

Sequences are packed as in flash-linear-attention's varlen API: tokens (T, ...) and cumulative offsets
``cu_seqlens`` [0, l0, l0 + l1, ...]; every sequence starts from its own initial state (zero by default).
The loop steps all sequences at once (padded at their ends with tokens that leave the state unchanged),
so it costs max(length) steps, not sum(length). :mod:`hf_distca.linear.ops.chunked` computes the same in
max(length) / 64 steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = ["Recurrence", "check_offsets", "check_recurrence_inputs", "run_reference", "transition_kind"]


class Recurrence(NamedTuple):
    """One recurrence call over packed sequences, checked by :func:`hf_distca.linear.ops.local.recurrence` (its
    arguments, with the offsets on the host): what every backend runs."""

    q: torch.Tensor
    """(T, H, K)"""
    k: torch.Tensor
    """(T, H, K)"""
    v: torch.Tensor
    """(T, H, V)"""
    bounds: list[int]
    """Host offsets [0, l0, l0 + l1, ..., T] of the N packed sequences."""
    log_decay: torch.Tensor | None
    """None (no decay), (H,), (T, H) or (T, H, K)."""
    beta: torch.Tensor | None
    """None, or (T, H) for the delta rule."""
    scale: float
    initial_state: torch.Tensor | None
    """(N, H, K, V), or None: zeros."""
    output_final_state: bool


def transition_kind(log_decay: torch.Tensor | None, beta: torch.Tensor | None) -> str:
    """'scalar' (per-head decay), 'vector' (per key-dim decay) or 'dense' (delta rule): the shape of the
    transition of a whole piece, which is what crosses ranks."""
    if beta is not None:
        return "dense"
    if log_decay is not None and log_decay.dim() == 3:
        return "vector"
    return "scalar"


def check_recurrence_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor | None,
    beta: torch.Tensor | None,
) -> None:
    """Raise a ValueError naming the shapes when q, k, v, log_decay, beta do not fit together."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"linear attention takes q, k (T, H, K) and v (T, H, V); got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    t, h, kd = q.shape
    if tuple(k.shape) != (t, h, kd) or tuple(v.shape[:2]) != (t, h):
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must share tokens and heads "
            "(and q, k the key dimension)"
        )
    if log_decay is not None and tuple(log_decay.shape) not in ((h,), (t, h), (t, h, kd)):
        raise ValueError(
            f"log_decay must be shaped (H,) = ({h},), (T, H) = ({t}, {h}) or (T, H, K) = ({t}, {h}, {kd}); "
            f"got {tuple(log_decay.shape)}"
        )
    if beta is not None and tuple(beta.shape) != (t, h):
        raise ValueError(f"beta must be shaped (T, H) = ({t}, {h}), got {tuple(beta.shape)}")


def check_offsets(
    cu_seqlens: Sequence[int], total: int, initial_state: torch.Tensor | None, shape: tuple[int, int, int]
) -> list[int]:
    """The host offsets of ``cu_seqlens`` as ints, after checking that they rise from 0 to ``total`` and that
    ``initial_state`` is None or (N, H, K, V) with (H, K, V) = ``shape``; a ValueError otherwise."""
    bounds = [int(x) for x in cu_seqlens]
    if len(bounds) < 1 or bounds[0] != 0 or bounds[-1] != total or bounds != sorted(bounds):
        raise ValueError(f"cu_seqlens must rise from 0 to T={total}, got {bounds[:8]}...")
    want = (len(bounds) - 1, *shape)
    if initial_state is not None and tuple(initial_state.shape) != want:
        raise ValueError(
            f"initial_state must be shaped (N, H, K, V) = {want}, got {tuple(initial_state.shape)}"
        )
    return bounds


def _padded_rows(cu_seqlens: Sequence[int], device: torch.device) -> tuple[torch.Tensor, int]:
    """(N, L) row index of every sequence's tokens, right-padded with the index T (a zero row)."""
    bounds = [int(x) for x in cu_seqlens]
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    longest = max(lengths, default=0)
    total = bounds[-1]
    rows = torch.full((len(lengths), longest), total, dtype=torch.long)  # (N, L)
    for n, (start, length) in enumerate(zip(bounds[:-1], lengths)):
        rows[n, :length] = torch.arange(start, start + length)
    return rows.to(device), longest


def _with_zero_row(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_zeros((1, *x.shape[1:]))])  # (T + 1, ...)


def run_reference(call: Recurrence) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the recurrence token by token (differentiable, any device and dtype): the oracle of the other
    backends. Returns o (T, H, V) and, if asked, the final states (N, H, K, V)."""
    q, k, v, bounds, log_decay, beta, scale, initial_state, output_final_state = call
    t, h, kd = q.shape
    vd = v.shape[-1]
    num_seqs = len(bounds) - 1
    rows, longest = _padded_rows(bounds, q.device)
    # padding steps must leave the state unchanged: zero key/value/beta, zero log decay (factor 1)
    q_p, k_p, v_p = (_with_zero_row(x)[rows] for x in (q, k, v))  # (N, L, H, K|V)
    g_p = None
    if log_decay is not None:
        g_full = log_decay.expand(t, h) if log_decay.dim() == 1 else log_decay  # (T, H) or (T, H, K)
        g_p = _with_zero_row(g_full)[rows]  # (N, L, H[, K])
    b_p = _with_zero_row(beta)[rows] if beta is not None else None  # (N, L, H)

    dtype = torch.promote_types(q.dtype, v.dtype)
    state = (
        initial_state.to(dtype)
        if initial_state is not None
        else q.new_zeros((num_seqs, h, kd, vd), dtype=dtype)
    )
    outs = []
    for step in range(longest):
        if g_p is not None:
            g = g_p[:, step].exp()  # (N, H) or (N, H, K)
            state = state * (g[..., None, None] if g.dim() == 2 else g[..., None])
        k_t, v_t = k_p[:, step], v_p[:, step]  # (N, H, K), (N, H, V)
        if b_p is not None:
            # delta rule: replace the value read at k_t by v_t, at rate beta_t
            read = torch.einsum("nhk,nhkv->nhv", k_t, state)  # (N, H, V)
            v_t = b_p[:, step][..., None] * (v_t - read)
        state = state + k_t[..., :, None] * v_t[..., None, :]  # (N, H, K, V)
        outs.append(torch.einsum("nhk,nhkv->nhv", q_p[:, step], state) * scale)  # (N, H, V)
    if longest:
        padded = torch.stack(outs, dim=1)  # (N, L, H, V)
        valid = rows < t  # (N, L)
        out = padded.new_zeros((t, h, vd)).index_copy(0, rows[valid], padded[valid])  # (T, H, V)
    else:
        out = v.new_zeros((t, h, vd))
    return out, (state if output_final_state else None)
