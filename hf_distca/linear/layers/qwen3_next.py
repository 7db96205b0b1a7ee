"""Qwen3-Next gated DeltaNet (Transformers' ``Qwen3NextGatedDeltaNet``) on sequence-parallel linear attention.

Its projections are fused per key head: ``in_proj_qkvz`` gives [q (Dk) | k (Dk) | v (r Dv) | z (r Dv)] and
``in_proj_ba`` [b (r) | a (r)], with r = Hv / Hk value heads per key head; z is the output gate of the
gated RMS norm ``norm``; beta = sigmoid(b); ``out_proj`` projects back. The shared computation and how
documents restart and continue across ranks: :mod:`hf_distca.linear.layers.gated_deltanet`.

Documents in a packed row (Transformers 5.24): with ``cu_seq_lens_q`` and no flash-linear-attention the
Transformers module refuses the row; with flash-linear-attention its recurrence gets ``cu_seqlens`` and
restarts per document, but its convolution gets no ``seq_idx`` and runs across document boundaries; with
position ids only (its decoder layer does not pass them on) it runs the row as one sequence. The
replacement equals the Transformers module run on each document alone.
"""

from __future__ import annotations

import torch

from hf_distca.linear.layers.gated_deltanet import GatedDeltaNetSP

__all__ = ["Qwen3NextGatedDeltaNetSP"]


class Qwen3NextGatedDeltaNetSP(GatedDeltaNetSP):
    """Drop-in replacement of one ``Qwen3NextGatedDeltaNet`` instance (same submodules and parameters)."""

    uses = ("in_proj_qkvz", "in_proj_ba", "norm", "out_proj")

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        hk, hv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        r = hv // hk
        qkvz = self.in_proj_qkvz(hidden).view(n, hk, 2 * dk + 2 * r * dv)  # (N, Hk, 2Dk + 2rDv)
        ba = self.in_proj_ba(hidden).view(n, hk, 2 * r)  # (N, Hk, 2r)
        q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=-1)
        b, a = torch.split(ba, [r, r], dim=-1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)  # (N, conv_dim)
        return mixed, z.reshape(n, hv, dv), b.reshape(n, hv), a.reshape(n, hv)

    def gated_norm(self, core: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.norm(core, gate)

    def output(self, core: torch.Tensor) -> torch.Tensor:
        return self.out_proj(core)
