"""OLMo-hybrid gated DeltaNet (Transformers' ``OlmoHybridGatedDeltaNet``) on sequence-parallel linear attention.

Separate projections: ``q_proj``, ``k_proj`` (Hk heads of Dk), ``v_proj`` (Hv heads of Dv), ``a_proj``,
``b_proj`` (one per value head) and the output gate ``g_proj``; beta = sigmoid(b), doubled when the
config's ``linear_allow_neg_eigval`` is set (range [0, 2]: the transition may flip a direction); the gated
RMS norm is ``o_norm`` and ``o_proj`` projects back. The shared computation and how documents restart and
continue across ranks: :mod:`hf_distca.linear.layers.gated_deltanet`.

Its decoder layer, like Qwen3-Next's, consumes ``position_ids`` without passing them on, and its
recurrence restarts per document only when given ``cu_seq_lens``; the replacement equals the Transformers
module run on each document alone.
"""

from __future__ import annotations

import torch

from hf_distca.linear.layers.gated_deltanet import GatedDeltaNetSP

__all__ = ["OlmoHybridGatedDeltaNetSP"]


class OlmoHybridGatedDeltaNetSP(GatedDeltaNetSP):
    """Drop-in replacement of one ``OlmoHybridGatedDeltaNet`` instance (same submodules and parameters)."""

    uses = (
        "q_proj",
        "k_proj",
        "v_proj",
        "a_proj",
        "b_proj",
        "g_proj",
        "o_norm",
        "o_proj",
        "allow_neg_eigval",
    )

    def __init__(self, original, **kwargs):
        super().__init__(original, **kwargs)
        self.allow_neg_eigval = bool(original.allow_neg_eigval)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        mixed = torch.cat(
            [self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)], dim=-1
        )  # (N, conv_dim)
        gate = self.g_proj(hidden).view(n, self.num_v_heads, self.head_v_dim)  # (N, Hv, Dv)
        return mixed, gate, self.b_proj(hidden), self.a_proj(hidden)  # b, a: (N, Hv)

    def beta(self, b: torch.Tensor) -> torch.Tensor:
        return b.sigmoid() * 2.0 if self.allow_neg_eigval else b.sigmoid()

    def gated_norm(self, core: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.o_norm(core, gate)

    def output(self, core: torch.Tensor) -> torch.Tensor:
        return self.o_proj(core)
