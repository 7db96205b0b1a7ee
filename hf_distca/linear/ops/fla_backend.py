"""flash-linear-attention's chunk kernels (package ``fla-core``, imported as ``fla``) behind the reference's API.

fla kernels take (B, T, H, D) with B = 1 for packed sequences, ``cu_seqlens`` as a long tensor on the
device, and states (N, H, K, V) in float32; they support ``initial_state`` and ``output_final_state``
with gradients for both, which is all the sequence-parallel path needs. Mapping:

- no decay / per-head decay (constant (H,) or per token (T, H)): ``chunk_simple_gla`` (``g_gamma`` / ``g``)
- per key-dim decay (T, H, K): ``chunk_gla``
- delta rule with a per-head gate (or none): ``chunk_gated_delta_rule``
- delta rule with a per key-dim gate (Kimi delta attention): ``chunk_kda``
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch

__all__ = ["fla_available", "recurrence_fla"]


def fla_available() -> bool:
    """Whether flash-linear-attention's ops can be imported (needs triton)."""
    return importlib.util.find_spec("fla") is not None and importlib.util.find_spec("triton") is not None


def recurrence_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens: Sequence[int],
    log_decay: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as :func:`hf_distca.linear.ops.recurrence.recurrence_reference`, on CUDA tensors."""
    if not q.is_cuda:
        raise ValueError(
            "the 'fla' linear-attention backend runs on CUDA tensors; use backend='reference' on CPU"
        )
    if not fla_available():
        raise ImportError("backend='fla' needs flash-linear-attention: pip install fla-core (and triton)")
    t, h, _ = q.shape
    bounds = [int(x) for x in cu_seqlens]
    cu_cpu = torch.tensor(bounds, dtype=torch.long)
    cu = cu_cpu.to(q.device)
    q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)  # (1, T, H, D)
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    common = dict(
        scale=scale,
        initial_state=h0,
        output_final_state=output_final_state,
        cu_seqlens=cu,
        cu_seqlens_cpu=cu_cpu,
    )
    if beta is None:
        if log_decay is not None and log_decay.dim() == 3:
            from fla.ops.gla import chunk_gla

            o, final = chunk_gla(q4, k4, v4, g=log_decay.float().unsqueeze(0), **common)
        else:
            from fla.ops.simple_gla import chunk_simple_gla

            if log_decay is None:
                o, final = chunk_simple_gla(q4, k4, v4, g_gamma=q.new_zeros(h, dtype=torch.float32), **common)
            elif log_decay.dim() == 1 and not log_decay.requires_grad:
                o, final = chunk_simple_gla(q4, k4, v4, g_gamma=log_decay.float(), **common)
            else:  # per-token gates; also a learnable constant, since fla gives g_gamma no gradient
                g = log_decay.float().expand(t, h) if log_decay.dim() == 1 else log_decay.float()
                o, final = chunk_simple_gla(q4, k4, v4, g=g.unsqueeze(0), **common)
    else:
        beta4 = beta.unsqueeze(0)  # (1, T, H)
        if log_decay is not None and log_decay.dim() == 3:
            from fla.ops.kda import chunk_kda

            o, final = chunk_kda(q4, k4, v4, g=log_decay.float().unsqueeze(0), beta=beta4, **common)
        else:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            if log_decay is None:
                g = q.new_zeros((t, h), dtype=torch.float32)
            elif log_decay.dim() == 1:
                g = log_decay.float().expand(t, h)
            else:
                g = log_decay.float()
            o, final = chunk_gated_delta_rule(q4, k4, v4, g=g.unsqueeze(0), beta=beta4, **common)
    return o.squeeze(0), final
