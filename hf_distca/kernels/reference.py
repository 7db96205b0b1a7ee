"""The reference kernel: plain softmax attention per sequence, the oracle of every test.

Scores are ``scale * q . k``, softcapped when ``seqs.softcap`` is set (``softcap * tanh(score /
softcap)``, Gemma 2), masked (bottom-right causal, optionally windowed), then softmaxed.

Any device, any dtype: computes in float32 (float64 for float64 inputs) and returns q's dtype. Queries
are processed in chunks so memory stays at O(chunk x Tk x Hq) per sequence. The forward is written
with differentiable torch ops (tests take torch.autograd of it as a second oracle); the backward is
the closed form from q, k, v, out, lse and dout that fused kernels implement.
"""

from __future__ import annotations

import torch

from hf_distca.kernels.common import ForwardTensors, PackedSeqs, VarlenOffsets, check_inputs, check_sinks
from hf_distca.kernels.sinks import with_sinks

_Q_CHUNK = 1024
_CHUNK_ELEMENTS = 1 << 26  # scores per chunk (Hq x rows x keys): 256 MiB in float32


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 by contract; float64 inputs keep float64 so that float64 backward stays float64-exact."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunks(q0: int, q1: int, lk: int, heads: int) -> list[tuple[int, int]]:
    rows = max(1, min(_Q_CHUNK, _CHUNK_ELEMENTS // max(1, lk * heads)))
    return [(c0, min(c0 + rows, q1)) for c0 in range(q0, q1, rows)]


def _causal_allowed(
    c0: int, c1: int, lq: int, lk: int, device: torch.device, window: int | None = None
) -> torch.Tensor:
    """(rows, lk) mask: query row r (index r in its shard of lq, position r + lk - lq of the keys) sees
    keys j with 0 <= r + lk - lq - j < window (no lower bound when ``window`` is None)."""
    rows = torch.arange(c0, c1, device=device).unsqueeze(1) + (lk - lq)  # (lc, 1), key positions
    cols = torch.arange(lk, device=device).unsqueeze(0)  # (1, lk)
    allowed = cols <= rows
    if window is not None:
        allowed = allowed & (cols > rows - window)
    return allowed


def _scores(
    qs: torch.Tensor, ks: torch.Tensor, scale: float, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(Hq, lc, lk) scores of queries qs (lc, Hq, D) against keys ks (lk, Hq, D), softcapped when
    ``softcap`` is set, and tanh(raw / softcap) (the backward's factor; None without softcap)."""
    scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale  # (Hq, lc, lk)
    if softcap is None:
        return scores, None
    squashed = torch.tanh(scores / softcap)  # (Hq, lc, lk)
    return softcap * squashed, squashed


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """out (Tq, Hq, D) in q.dtype and lse (Tq, Hq); differentiable through autograd."""
    groups = q.shape[1] // k.shape[1]
    compute = _compute_dtype(q.dtype)
    outs, lses = [], []
    for i in range(seqs.num_seqs):
        q0, k0, k1 = seqs.q_bounds[i], seqs.k_bounds[i], seqs.k_bounds[i + 1]
        lq, lk = seqs.q_len(i), seqs.k_len(i)
        if lq == 0:
            continue
        ks = k[k0:k1].to(compute).repeat_interleave(groups, dim=1)  # (lk, Hq, D)
        vs = v[k0:k1].to(compute).repeat_interleave(groups, dim=1)  # (lk, Hq, D)
        for c0, c1 in _chunks(0, lq, lk, q.shape[1]):
            qs = q[q0 + c0 : q0 + c1].to(compute)  # (lc, Hq, D)
            scores, _ = _scores(qs, ks, scale, seqs.softcap)  # (Hq, lc, lk)
            allowed = _causal_allowed(c0, c1, lq, lk, q.device, seqs.window)
            scores = scores.masked_fill(~allowed, float("-inf"))
            lse = torch.logsumexp(scores, dim=-1)  # (Hq, lc); every row sees >= 1 key (itself)
            probs = torch.exp(scores - lse.unsqueeze(-1))  # (Hq, lc, lk)
            outs.append(torch.einsum("hqk,khd->qhd", probs, vs))  # (lc, Hq, D)
            lses.append(lse.transpose(0, 1))  # (lc, Hq)
    if not outs:
        # no query rows: keep the graph connected to q, k and v so autograd returns zeros, not None
        empty = (q[:0].to(compute).sum() + k.to(compute).sum() + v.to(compute).sum()) * 0
        out = (q.to(compute) * 0 + empty).to(q.dtype)  # (0, Hq, D)
        return out, torch.zeros(0, q.shape[1], dtype=_lse_dtype(q.dtype), device=q.device)
    return torch.cat(outs).to(q.dtype), torch.cat(lses).to(_lse_dtype(q.dtype))


def backward(
    dout: torch.Tensor, fwd: ForwardTensors, seqs: PackedSeqs, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Closed-form gradients: P = exp(S - lse), dV = P^T dO, dP = dO V^T, delta = rowsum(dO * O),
    dS = P * (dP - delta), dQ = scale dS K, dK = scale dS^T Q; GQA sums dK/dV over each query group.
    With softcap, S = c tanh(R / c) of the raw scaled scores R, and dR = dS * (1 - tanh^2(R / c))."""
    q, k, v, out, lse = fwd
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    groups = hq // hkv
    compute = _compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=compute, device=q.device)  # (Tq, Hq, D)
    dk = torch.zeros(k.shape, dtype=compute, device=k.device)  # (Tk, Hkv, D)
    dv = torch.zeros(v.shape, dtype=compute, device=v.device)  # (Tk, Hkv, D)
    for i in range(seqs.num_seqs):
        q0, k0, k1 = seqs.q_bounds[i], seqs.k_bounds[i], seqs.k_bounds[i + 1]
        lq, lk = seqs.q_len(i), seqs.k_len(i)
        if lq == 0:
            continue  # keys nobody queries get zero gradients
        ks = k[k0:k1].to(compute).repeat_interleave(groups, dim=1)  # (lk, Hq, D)
        vs = v[k0:k1].to(compute).repeat_interleave(groups, dim=1)  # (lk, Hq, D)
        dk_seq = torch.zeros(lk, hq, d, dtype=compute, device=q.device)  # (lk, Hq, D), per query head
        dv_seq = torch.zeros(lk, hq, d, dtype=compute, device=q.device)  # (lk, Hq, D)
        for c0, c1 in _chunks(0, lq, lk, hq):
            rows = slice(q0 + c0, q0 + c1)
            qs, dos, os = (t[rows].to(compute) for t in (q, dout, out))  # (lc, Hq, D) each
            scores, squashed = _scores(qs, ks, scale, seqs.softcap)  # (Hq, lc, lk)
            allowed = _causal_allowed(c0, c1, lq, lk, q.device, seqs.window)
            scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.exp(scores - lse[rows].to(compute).transpose(0, 1).unsqueeze(-1))  # (Hq, lc, lk)
            dv_seq += torch.einsum("hqk,qhd->khd", probs, dos)
            dprobs = torch.einsum("qhd,khd->hqk", dos, vs)  # (Hq, lc, lk)
            delta = (dos * os).sum(-1).transpose(0, 1).unsqueeze(-1)  # (Hq, lc, 1)
            dscores = probs * (dprobs - delta)  # (Hq, lc, lk)
            if squashed is not None:  # d/dR of c tanh(R / c); masked entries have probs 0
                dscores = dscores * (1 - squashed * squashed)
            dq[rows] = scale * torch.einsum("hqk,khd->qhd", dscores, ks)
            dk_seq += scale * torch.einsum("hqk,qhd->khd", dscores, qs)
        dk[k0:k1] = dk_seq.view(lk, hkv, groups, d).sum(2)  # query head h uses KV head h // groups
        dv[k0:k1] = dv_seq.view(lk, hkv, groups, d).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def reference_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The oracle: the reference forward differentiated by torch.autograd (no explicit backward; with
    ``sinks``, differentiable w.r.t. them too).

    Same packed sequences, masking, softcapping and sinks as :func:`hf_distca.kernels.attention_forward`; returns
    out, and with ``return_lse`` also lse.
    """
    offsets = VarlenOffsets(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    seqs = check_inputs(q, k, v, offsets, window, softcap)
    out, lse = forward(q, k, v, seqs, q.shape[-1] ** -0.5 if scale is None else scale)
    if sinks is not None:
        check_sinks(sinks, q)
        out, lse = with_sinks(out, lse, sinks)
    return (out, lse) if return_lse else out
