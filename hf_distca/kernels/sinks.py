"""Attention sinks (gpt-oss's ``sinks``, passed to the attention function as ``s_aux``): one learned logit
per query head that joins every row's softmax as an extra column carrying no value.

Exact on every backend from the plain attention's output and log-sum-exp, with no change to the kernels:
with L = logaddexp(lse, sink), the row's probabilities are exp(s - L) = exp(s - lse) * exp(lse - L), so

- forward: out = out_plain * exp(lse - L), and L is the log-sum-exp of the row including the sink;
- backward of q, k, v: the unchanged kernel backward given (out, L) instead of (out_plain, lse). With
  P' = exp(S - L): dV = P'^T dO; d out / d s_j = P'_j (v_j - out), so dS = P' (dO V^T - rowsum(dO * out)),
  which is what every backend computes from the out and log-sum-exp it is handed;
- backward of the sinks: :func:`sinks_backward`.
"""

from __future__ import annotations

import torch


def with_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention sinks (gpt-oss) from the plain attention's (out, lse): the softmax of a row over
    [scores, sink[h]] puts exp(sink - L) on the sink column, which carries no value, with
    L = logaddexp(lse, sink); the other probabilities shrink by exp(lse - L). Returns out * exp(lse - L)
    in out's dtype and L (lse's dtype). Differentiable (autograd of it is the oracle of
    :func:`sinks_backward`)."""
    total = torch.logaddexp(lse, sinks.to(lse.dtype))  # (Tq, Hq), sinks broadcast over rows
    kept = torch.exp(lse - total).unsqueeze(-1)  # (Tq, Hq, 1): 1 - p_sink
    return (out.to(lse.dtype) * kept).to(out.dtype), total


def sinks_backward(
    dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """Gradient of the sinks from :func:`with_sinks`'s out and L (``lse``) and dout: out_r = (1 - p_r) o_r
    with p_r = exp(sink - L_r), and d(1 - p_r)/d sink = -p_r (1 - p_r), so
    dsink[h] = -sum_r p_r[h] * (dout_r[h] . out_r[h]). (Tq, Hq, D), (Tq, Hq) -> (Hq,) in sinks' dtype."""
    compute = lse.dtype
    p_sink = torch.exp(sinks.to(compute) - lse)  # (Tq, Hq)
    dot = (dout.to(compute) * out.to(compute)).sum(-1)  # (Tq, Hq)
    return -(p_sink * dot).sum(0).to(sinks.dtype)  # (Hq,)
