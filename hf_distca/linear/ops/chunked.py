"""The linear-attention recurrences in chunks of C tokens: plain PyTorch, any device, differentiable by autograd.

The backend 'chunked' of :func:`hf_distca.linear.ops.local.recurrence` (the reference's math). Inside one chunk of a
sequence, with S_0 the state entering it, G_t = g_1 + ... + g_t the cumulative log decay since the chunk
start (per head, or per key dimension) and Gamma_t = exp(G_t):

- diagonal decay: ``S_t = diag(Gamma_t) S_0 + sum_{s<=t} diag(Gamma_t / Gamma_s) k_s v_s^T``, so::

      o = scale (P V + (Q * Gamma) S_0)          S_C = diag(Gamma_C) S_0 + Kd^T V

  with ``P_ts = sum_k q_tk k_sk exp(G_tk - G_sk)`` for s <= t (0 above the diagonal) and
  ``Kd_s = k_s * exp(G_C - G_s)``;
- delta rule: the same with v_s replaced by ``u_s = beta_s (v_s - (D_s S_{s-1})^T k_s)``, which inside a
  chunk solves ``(I + A) U = diag(beta) (V - (Gamma * K) S_0)`` with the strictly lower triangular
  ``A_ts = beta_t sum_k k_tk k_sk exp(G_tk - G_sk)`` (s < t; the UT / WY form). With ``W1, W2`` the
  solutions for the right-hand sides ``diag(beta) V`` and ``diag(beta) (Gamma * K)``, ``U = W1 - W2 S_0``::

      o = scale (P W1 + (Q * Gamma - P W2) S_0)    S_C = (diag(Gamma_C) - Kd^T W2) S_0 + Kd^T W1

Every chunk is thus an affine map of its entering state, ``S_C = A_c S_0 + B_c`` and
``o = scale (O_c + Q_c S_0)``. A_c, B_c, O_c and Q_c are computed for all chunks of all sequences at once;
one loop over the chunk index then carries the states, all sequences stepped together (longest first, the
others dropping out as they end), and the outputs follow in parallel again. Only exponentials of
non-positive numbers are taken (G_t - G_s for s <= t, the other entries masked before ``exp``; G_t;
G_C - G_s), so strong decays underflow to zero and never overflow, and nothing is divided by a decay. The
(chunks, H, C, C, K) pairwise decays of per-key-dim gates are built for groups of chunks, under activation
checkpointing when gradients are needed, so they never exist for all chunks at once.

States and decays are computed in float32 at least (float64 stays float64); outputs come back in the
inputs' dtype and final states in the compute dtype.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from hf_distca.linear.ops.recurrence import Recurrence

__all__ = ["CHUNK_SIZE", "run_chunked"]

CHUNK_SIZE = 64
"""Tokens per chunk (fla's chunk size as well)."""

_PAIRWISE_ELEMENTS = 1 << 24
"""Largest (chunks, H, C, C, K) pairwise-decay block built at once for per-key-dim gates (64 MiB in float32)."""


class _Layout:
    """Chunks of the packed sequences in step-major order: all sequences' first chunks (longest sequence
    first), then all second chunks, ... so that the chunks of loop step c are one contiguous range."""

    def __init__(self, bounds: list[int], chunk: int, device: torch.device):
        offsets = torch.tensor(bounds, dtype=torch.long)  # (N + 1,)
        lengths = offsets[1:] - offsets[:-1]  # (N,)
        counts = (lengths + chunk - 1) // chunk  # (N,) chunks per sequence
        order = torch.sort(counts, descending=True, stable=True).indices  # (N,): ties keep packed order
        by_count = counts[order]
        steps = int(by_count[0]) if len(by_count) else 0
        active = (by_count[None, :] > torch.arange(steps)[:, None]).sum(1)  # (steps,): sequences in step c
        step = torch.repeat_interleave(torch.arange(steps), active)  # (M,): step of every chunk
        first = torch.cumsum(active, 0) - active  # (steps,): first chunk of each step
        seq = order[torch.arange(len(step)) - first[step]]  # (M,): its sequence
        start = offsets[seq] + step * chunk  # (M,) its first token
        size = torch.minimum(lengths[seq] - step * chunk, torch.tensor(chunk))  # (M,) its tokens
        self.active: list[int] = active.tolist()
        self.order = order.to(device)  # (N,)
        self.num_started = self.active[0] if self.active else 0  # sequences with at least one token
        within = torch.arange(chunk)  # (C,)
        valid = within[None, :] < size[:, None]  # (M, C)
        self.valid = valid.to(device)
        self.rows = torch.where(valid, start[:, None] + within[None, :], bounds[-1]).to(
            device
        )  # (M, C); T: pad


def _gather(x: torch.Tensor, layout: _Layout, dtype: torch.dtype) -> torch.Tensor:
    """Token rows (T, H, ...) -> chunks (M, H, C, ...), padded with zeros (no key, value, gate or beta)."""
    padded = torch.cat([x.to(dtype), x.new_zeros((1, *x.shape[1:]), dtype=dtype)])  # (T + 1, H, ...)
    return padded[layout.rows].transpose(1, 2)  # (M, C, H, ...) -> (M, H, C, ...)


def _pairwise_vector(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, causal: torch.Tensor, delta: bool
) -> tuple[torch.Tensor, ...]:
    """P (and, for the delta rule, sum_k k_tk k_sk exp(G_tk - G_sk)) of a group of chunks with per-key-dim
    cumulative log decays g; q, k, g: (m, H, C, K); causal: (C, C) bool, s <= t. Returns (m, H, C, C)."""
    diff = g[:, :, :, None, :] - g[:, :, None, :, :]  # (m, H, C, C, K): [t, s] = G_t - G_s
    decay = diff.masked_fill(~causal[:, :, None], float("-inf")).exp()  # exp of non-positive numbers only
    keys = decay * k[:, :, None, :, :]  # (m, H, C, C, K): k_s exp(G_t - G_s)
    scores = torch.einsum("mhtk,mhtsk->mhts", q, keys)  # (m, H, C, C)
    if not delta:
        return (scores,)
    return scores, torch.einsum("mhtk,mhtsk->mhts", k, keys)


def _vector_scores(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, causal: torch.Tensor, delta: bool
) -> tuple[torch.Tensor, ...]:
    """``_pairwise_vector`` over all chunks, a group of chunks at a time (recomputed in backward)."""
    m, h, c, kd = q.shape
    group = max(1, _PAIRWISE_ELEMENTS // max(1, h * c * c * kd))
    keep = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, g))
    parts = []
    for lo in range(0, m, group):
        args = (q[lo : lo + group], k[lo : lo + group], g[lo : lo + group], causal, delta)
        if keep:
            parts.append(checkpoint(_pairwise_vector, *args, use_reentrant=False))
        else:
            parts.append(_pairwise_vector(*args))
    return tuple(torch.cat(p) for p in zip(*parts))


def _apply(a: torch.Tensor | None, state: torch.Tensor) -> torch.Tensor:
    """A_c S for chunk transitions a: None (identity), (a, H) per head, (a, H, K) per key dim or (a, H, K, K)."""
    if a is None:
        return state
    if a.dim() == 2:
        return a[:, :, None, None] * state
    if a.dim() == 3:
        return a[:, :, :, None] * state
    return a @ state  # (a, H, K, K) @ (a, H, K, V)


def run_chunked(call: Recurrence, chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The recurrence over packed sequences in chunks of ``chunk_size`` tokens (see the module docstring).

    Returns o (T, H, V) in the inputs' dtype and, if asked, the final states (N, H, K, V) in the compute
    dtype (float32 at least).
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    q, k, v, bounds, log_decay, beta, scale, initial_state, output_final_state = call
    t, h, kd = q.shape
    vd = v.shape[-1]
    out_dtype = torch.promote_types(q.dtype, v.dtype)
    dtype = torch.promote_types(out_dtype, torch.float32)
    device = q.device
    layout = _Layout(bounds, chunk_size, device)
    qc, kc, vc = (_gather(x, layout, dtype) for x in (q, k, v))  # (M, H, C, K|V)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=device).tril()  # (C, C): s <= t

    # cumulative log decays from the chunk start: (M, H, C) per head, (M, H, C, K) per key dim
    g = None
    if log_decay is not None:
        g_tokens = log_decay.expand(t, h) if log_decay.dim() == 1 else log_decay  # (T, H) or (T, H, K)
        g = _gather(g_tokens, layout, dtype).cumsum(2)
    delta = beta is not None
    if g is None:
        gamma = last = None
        scores = (qc @ kc.transpose(-1, -2)).masked_fill(~causal, 0.0)  # (M, H, C, C)
        keys = kc @ kc.transpose(-1, -2) if delta else None
    elif g.dim() == 3:  # per head
        g = g[..., None]  # (M, H, C, 1)
        gamma, last = g.exp(), g[:, :, -1, 0]  # (M, H, C, 1), (M, H)
        diff = g - g.transpose(-1, -2)  # (M, H, C, C): [t, s] = G_t - G_s
        decay = diff.masked_fill(~causal, float("-inf")).exp()  # exp of non-positive numbers only
        scores = (qc @ kc.transpose(-1, -2)) * decay
        keys = (kc @ kc.transpose(-1, -2)) * decay if delta else None
    else:  # per key dim
        gamma, last = g.exp(), g[:, :, -1]  # (M, H, C, K), (M, H, K)
        scores, *rest = _vector_scores(qc, kc, g, causal, delta)
        keys = rest[0] if delta else None
    q_dec = qc if gamma is None else qc * gamma  # (M, H, C, K): Gamma * Q
    k_end = kc if g is None else kc * (g[:, :, -1:] - g).exp()  # (M, H, C, K): exp(G_C - G_s) * K
    decay_end = last.exp() if last is not None else None  # (M, H) or (M, H, K): Gamma_C

    if not delta:
        o_loc = scores @ vc  # (M, H, C, V)
        q_state = q_dec  # (M, H, C, K)
        b_chunk = k_end.transpose(-1, -2) @ vc  # (M, H, K, V)
        a_chunk = decay_end  # diagonal: (M, H) / (M, H, K), or None
    else:
        bc = _gather(beta, layout, dtype)  # (M, H, C)
        lower = (keys * bc[..., None]).tril(-1)  # (M, H, C, C): A, strictly lower
        eye = torch.eye(chunk_size, dtype=dtype, device=device)
        k_dec = kc if gamma is None else kc * gamma  # (M, H, C, K): Gamma * K
        rhs = torch.cat([vc, k_dec], dim=-1) * bc[..., None]  # (M, H, C, V + K)
        w = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True)
        w1, w2 = w.split([vd, kd], dim=-1)  # (M, H, C, V), (M, H, C, K)
        o_loc = scores @ w1
        q_state = q_dec - scores @ w2
        b_chunk = k_end.transpose(-1, -2) @ w1  # (M, H, K, V)
        eye_k = torch.eye(kd, dtype=dtype, device=device)
        if decay_end is None:
            diag = eye_k.expand(len(kc), h, kd, kd)
        elif decay_end.dim() == 2:
            diag = decay_end[:, :, None, None] * eye_k
        else:
            diag = torch.diag_embed(decay_end)
        a_chunk = diag - k_end.transpose(-1, -2) @ w2  # (M, H, K, K)

    # states entering each chunk: one step per chunk index, the sequences still running stepped together
    num_seqs = len(bounds) - 1
    if initial_state is not None:
        start = initial_state.to(dtype).index_select(0, layout.order)  # (N, H, K, V), longest first
    else:
        start = q.new_zeros((num_seqs, h, kd, vd), dtype=dtype)
    state = start[: layout.num_started]
    entering, ended, offset = [], [], 0
    for step, live in enumerate(layout.active):
        entering.append(state)
        chunk_a = None if a_chunk is None else a_chunk[offset : offset + live]
        state = _apply(chunk_a, state) + b_chunk[offset : offset + live]
        offset += live
        keep = layout.active[step + 1] if step + 1 < len(layout.active) else 0
        ended.append(state[keep:])  # sequences whose last chunk this was (longest first order)
        state = state[:keep]

    if entering:
        s0 = torch.cat(entering)  # (M, H, K, V), in chunk order
        o_chunks = (o_loc + q_state @ s0) * scale  # (M, H, C, V)
        o_rows = o_chunks.transpose(1, 2)[layout.valid]  # (T, H, V) in chunk order
        out = o_rows.new_zeros((t, h, vd)).index_copy(0, layout.rows[layout.valid], o_rows)
    else:
        out = v.new_zeros((t, h, vd), dtype=dtype)
    final = None
    if output_final_state:
        by_length = torch.cat([*reversed(ended), start[layout.num_started :]])  # (N, H, K, V), longest first
        final = by_length.index_select(0, torch.argsort(layout.order))  # (N, H, K, V), packed order
    return out.to(out_dtype), final
