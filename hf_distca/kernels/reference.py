"""The fp32 reference kernel: plain softmax attention per sequence. It is the oracle of every test.

Any device, any dtype (computes in float32, or float64 for float64 inputs; returns q's dtype), differentiable through autograd.
Queries are processed in chunks so memory stays at O(chunk x Tk) per sequence.
"""

from __future__ import annotations

import torch

_Q_CHUNK = 1024


def reference_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    scale: float,
    causal: bool = True,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """See :func:`hf_distca.kernels.varlen_attention`."""
    groups = q.shape[1] // k.shape[1]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    cu_q = cu_seqlens_q.tolist()
    cu_k = cu_seqlens_k.tolist()
    outs, lses = [], []
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        lq, lk = q1 - q0, k1 - k0
        if lq == 0:
            continue
        if causal and lk < lq:
            raise ValueError(
                f"sequence {i}: {lq} queries but only {lk} keys; bottom-right causal attention needs "
                "at least as many keys as queries"
            )
        if lk == 0:
            raise ValueError(f"sequence {i}: {lq} queries attend to no keys")
        ks = k[k0:k1].to(compute).repeat_interleave(groups, dim=1)  # (lk, Hq, D)
        vs = v[k0:k1].to(compute).repeat_interleave(groups, dim=1)  # (lk, Hq, D)
        for c0 in range(q0, q1, _Q_CHUNK):
            c1 = min(c0 + _Q_CHUNK, q1)
            qs = q[c0:c1].to(compute)  # (lc, Hq, D)
            scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale  # (Hq, lc, lk)
            if causal:
                # query row r (absolute index c0 - q0 + r in the shard) sees keys j <= r + offset.
                rows = torch.arange(c0 - q0, c1 - q0, device=q.device).unsqueeze(1)  # (lc, 1)
                cols = torch.arange(lk, device=q.device).unsqueeze(0)  # (1, lk)
                allowed = cols <= rows + (lk - lq)  # (lc, lk)
                scores = scores.masked_fill(~allowed, float("-inf"))
            lse = torch.logsumexp(scores, dim=-1)  # (Hq, lc)
            probs = torch.exp(scores - lse.unsqueeze(-1))  # (Hq, lc, lk)
            outs.append(torch.einsum("hqk,khd->qhd", probs, vs))  # (lc, Hq, D)
            lses.append(lse.transpose(0, 1))  # (lc, Hq)
    if outs:
        out = torch.cat(outs).to(q.dtype)
        lse_all = torch.cat(lses).float()
    else:
        # keep the graph connected so callers can still backpropagate through an empty batch
        out = (q[:0].float() * 0).to(q.dtype)
        lse_all = torch.zeros(0, q.shape[1], dtype=torch.float32, device=q.device)
    if out.shape[0] != q.shape[0]:
        raise ValueError(f"cu_seqlens_q covers {out.shape[0]} queries but q holds {q.shape[0]}")
    return (out, lse_all) if return_lse else out
