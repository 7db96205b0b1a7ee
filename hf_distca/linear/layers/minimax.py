"""MiniMax lightning attention (Transformers' ``MiniMaxLightningAttention``) on sequence-parallel linear attention.

The Transformers module computes, per head, ``S_t = exp(-slope) S_{t-1} + k_t v_t^T``, ``o_t = S_t^T q_t``
(no query scaling) over the whole row, then RMS norm, a sigmoid output gate and the output projection.
Its recurrence runs across the documents of a packed row. The replacement keeps the very same parameter
and buffer objects under the same names (so ``state_dict`` / ``save_pretrained`` are unchanged) and
computes the same recurrence per document: restarting at every document boundary, and, with a
``distca_layout`` kwarg, continuing documents cut across ranks through the state scan.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from hf_distca.linear.config import LinearSPConfig
from hf_distca.linear.layers.rows import cu_seqlens_of, input_pieces
from hf_distca.linear.ops.local import prepare_backend, recurrence
from hf_distca.linear.ops.sequence_parallel import linear_attention

__all__ = ["MiniMaxLightningAttentionSP"]

_USED = ("qkv_proj", "out_proj", "output_gate", "norm", "act_fn", "slope_rate")


class MiniMaxLightningAttentionSP(nn.Module):
    """Drop-in replacement of one ``MiniMaxLightningAttention`` instance (same submodules and buffers)."""

    linear_kind = "const"
    """The transition of its recurrence: a fixed per-head decay (an fla kind, see ``fla_backend.fla_kind``)."""

    def __init__(self, original: nn.Module, *, group=None, config: LinearSPConfig | None = None):
        super().__init__()
        # the original's submodules and buffers, same objects, same names, same order (same state_dict)
        for name, child in original.named_children():
            self.add_module(name, child)
        saved = {key for key in original.state_dict(keep_vars=True) if "." not in key}  # persistent buffers
        for name, buffer in original.named_buffers(recurse=False):
            self.register_buffer(name, buffer, persistent=name in saved)
        missing = [n for n in _USED if not hasattr(self, n)]
        if missing:
            raise ValueError(
                f"{type(original).__name__} lacks {missing}; this Transformers version's MiniMax lightning "
                "attention is not the one MiniMaxLightningAttentionSP was written for"
            )
        self.layer_idx = original.layer_idx
        self.head_dim = original.head_dim
        self.num_attention_heads = original.num_attention_heads
        self.num_hidden_layers = original.num_hidden_layers
        self.block_size = original.block_size
        self.layer_type = getattr(original, "layer_type", "linear_attention")
        self.linear_sp_group = group
        self.linear_sp_config = config if config is not None else LinearSPConfig()
        # the local backend of its CUDA forwards, chosen now: an explicit 'fla' that cannot run raises here
        self.linear_sp_backend = prepare_backend(self.linear_sp_config.backend, self.linear_kind)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        past_key_values=None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """hidden_states (B, S, hidden) -> (out (B, S, hidden), None), as the Transformers module."""
        if cache is not None or past_key_values is not None:
            raise ValueError(
                "MiniMaxLightningAttentionSP keeps no decoding cache: run training forwards with use_cache=False "
                "(model.config.use_cache = False); generate with the original Transformers module"
            )
        batch, seq, _ = hidden_states.shape
        heads, dim = self.num_attention_heads, self.head_dim
        qkv = self.act_fn(self.qkv_proj(hidden_states))  # (B, S, 3 * H * D)
        mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
        if mask is not None:
            qkv = qkv * mask[:, :, None].to(qkv.dtype)  # padding adds nothing to the state
        qkv = qkv.view(batch * seq, heads, 3 * dim)  # (B * S, H, 3D): rows flattened, one packed stream
        q, k, v = torch.split(qkv, dim, dim=-1)  # (B * S, H, D) each
        log_decay = -self.slope_rate.reshape(heads)  # (H,): per-head constant decay exp(-slope)
        pieces, all_pieces = input_pieces(
            batch, seq, mask=mask, kwargs=kwargs, position_ids=kwargs.get("position_ids")
        )
        backend = self.linear_sp_backend if q.is_cuda else self.linear_sp_config.backend
        if all_pieces is not None:
            out = linear_attention(
                q,
                k,
                v,
                pieces,
                log_decay=log_decay,
                scale=1.0,
                group=self.linear_sp_group,
                all_pieces=all_pieces,
                config=dataclasses.replace(self.linear_sp_config, backend=backend),
            )
        else:
            out, _ = recurrence(
                q,
                k,
                v,
                cu_seqlens=cu_seqlens_of(pieces),
                log_decay=log_decay,
                scale=1.0,
                backend=backend,
            )
        out = out.reshape(batch, seq, heads * dim)  # (B, S, H * D)
        out = self.norm(out)
        out = F.sigmoid(self.output_gate(hidden_states)) * out
        return self.out_proj(out), None
