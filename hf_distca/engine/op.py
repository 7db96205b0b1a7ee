"""The attention operators: one autograd.Function with an explicit forward and backward.

``core_attention`` (balanced over the ranks of a group) and ``local_attention`` (one process, its own
documents) both run through :class:`_AttentionOp`; they differ only in the runner that does the work:

- :class:`EngineRunner`: forward = dispatch -> compute -> return_outputs -> gather_outputs; backward =
  dispatch_backward -> compute_backward -> return_grads -> gather_grads (see :mod:`.stages`).
- :class:`LocalRunner`: the kernel's forward and backward on this process's own rows.

What is kept from forward to backward, per layer and rank (T: local rows, Tk: rows of the tasks this
rank serves, both ~T after balancing; Hq/Hkv heads, D head_dim, b bytes per element):

- the owner's q, k, v and output (``save_for_backward``): T x (2 Hq + 2 Hkv) x D x b — what any
  attention implementation keeps; under activation checkpointing these are dropped and refilled by the
  recompute, except the output, which rematerialization-aware checkpointing keeps (T x Hq x D x b) so
  that attention is not recomputed (:mod:`hf_distca.checkpointing`);
- the server's log-sum-exp (an attribute, in its kernel row order): Tk x Hq x 4 bytes;
- nothing else: the server frees the q/k/v rows it received once its forward kernel has run.
Transient, within one stage: the server's pools (its rows plus the received ones) and their kernel-order
copies (a KV prefix read by two tasks twice); in backward the same for q, out, dout, k, v, plus float32
dk/dv accumulators for bf16/fp16 inputs.

Bytes per layer sent by one rank, with Q = its query rows sent to other servers x Hq x D x b (outputs,
output gradients and dq have the same size), KV = its KV-prefix rows sent x Hkv x D x b (each of k and
v), and Q', KV' the same for the rows it serves for other ranks: forward Q + 2 KV (dispatch) and Q'
(return); backward 3 Q + 2 KV (q, out, dout, k, v re-sent) and Q' + 2 KV' (dq, dk, dv home). Summed
over ranks (sum Q = sum Q', sum KV = sum KV') that is 6 Q + 6 KV per layer: what plain activation
recompute cost with an engine that kept the received rows until backward, and one forward (Q + 2 KV +
Q') less than plain recompute with this engine. Rematerialization-aware checkpointing adds nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_distca import metrics
from hf_distca.checkpointing import SavedAttention, keep_for_recompute, take_saved_attention
from hf_distca.config import DistCAConfig
from hf_distca.engine.prepare import PreparedAttention, prepare
from hf_distca.engine.stages import (
    compute,
    compute_backward,
    dispatch,
    dispatch_backward,
    gather_grads,
    gather_outputs,
    return_grads,
    return_outputs,
)
from hf_distca.kernels import attention_backward, attention_forward


def _wait(exchange) -> torch.Tensor | None:
    return None if exchange is None else exchange.wait()


@dataclass(frozen=True)
class EngineRunner:
    """Balanced core attention of one micro-batch over ``group`` (all ranks call together)."""

    prepared: PreparedAttention
    group: Any
    scale: float | None
    backend: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        prep, group = self.prepared, self.group
        received = _wait(dispatch(prep, q, k, v, group))
        out_kernel, lse = compute(prep, q, k, v, received, scale=self.scale, backend=self.backend)
        del received  # the server keeps nothing it received
        returned = _wait(return_outputs(prep, out_kernel, group))
        return gather_outputs(prep, out_kernel, returned), lse

    def backward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        prep, group = self.prepared, self.group
        received = _wait(dispatch_backward(prep, q, k, v, out, dout, group))
        dq_k, dk_k, dv_k = compute_backward(
            prep, q, k, v, out, dout, lse, received, scale=self.scale, backend=self.backend
        )
        del received
        return gather_grads(prep, return_grads(prep, dq_k, dk_k, dv_k, group), k.dtype)


@dataclass(frozen=True)
class LocalRunner:
    """Causal attention of this process's own sequences (no communication)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    scale: float | None
    backend: str

    def _seqs(self) -> tuple:
        return self.cu_seqlens_q, self.cu_seqlens_k, self.max_seqlen_q, self.max_seqlen_k

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if q.shape[0]:
            metrics.record_forward_kernel()
        return attention_forward(q, k, v, *self._seqs(), scale=self.scale, backend=self.backend)

    def backward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return attention_backward(
            dout.contiguous(), q, k, v, out, lse, *self._seqs(), scale=self.scale, backend=self.backend
        )


class _AttentionOp(torch.autograd.Function):
    """out = attention(q, k, v) by ``runner``; or, with ``saved`` (a rematerialization-aware recompute),
    the kept output without running anything. Saves exactly (q, k, v, out) either way, so that
    checkpointing's recompute refills the original node's saved tensors one for one."""

    @staticmethod
    def forward(ctx, q, k, v, runner, saved: SavedAttention | None):  # type: ignore[override]
        if saved is None:
            out, lse = runner.forward(q, k, v)
            keep_for_recompute(out, lse, runner)
        else:
            out, lse, runner = saved.out.view_as(saved.out), saved.lse, saved.runner
        ctx.save_for_backward(q, k, v, out)
        ctx.lse, ctx.runner = lse, runner
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out = ctx.saved_tensors
        dq, dk, dv = ctx.runner.backward(q, k, v, out, ctx.lse, dout)
        return dq, dk, dv, None, None


def _replay(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, saved: SavedAttention) -> torch.Tensor:
    metrics.record_replay()
    return _AttentionOp.apply(q, k, v, saved.runner, saved)


def core_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pieces: Sequence[Sequence[int]],
    *,
    group: Any = None,
    config: DistCAConfig | None = None,
    scale: float | None = None,
    all_pieces: Sequence[Sequence[Sequence[int]]] | None = None,
) -> torch.Tensor:
    """Causal per-document attention of this rank's queries, computed by balanced attention servers.

    q: (T_local, H_q, D); k, v: (T_local, H_kv, D), this rank's tokens in local order.
    pieces: this rank's ``(doc_id, doc_start, length)`` runs in local order (doc ids are global).
    group: the attention-server process group (None: the world when torch.distributed is
    initialized, else a single process). Every rank of the group must call collectively.
    all_pieces: every rank's pieces, when the caller already has them (skips an all-gather per call);
    pass one object per micro-batch and reuse it for every layer: the ranks' inputs are checked against
    each other on the first call with each new object (see :mod:`hf_distca.engine.prepare`).
    Returns (T_local, H_q, D), differentiable w.r.t. q, k and v. Inside a rematerialization-aware
    checkpoint recompute, returns the output kept from the forward (no planning, no communication).
    """
    saved = take_saved_attention(q.shape[0])
    if saved is not None:
        return _replay(q, k, v, saved)
    config = config or DistCAConfig()
    prepared = prepare(q, k, v, pieces, group=group, config=config, all_pieces=all_pieces)
    metrics.record_call(prepared.flops_before, prepared.flops_after)
    return _AttentionOp.apply(q, k, v, EngineRunner(prepared, group, scale, config.backend), None)


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal (bottom-right aligned) varlen attention of this process's own sequences, differentiable,
    with the same operator as :func:`core_attention` (so rematerialization-aware checkpointing applies).
    Arguments as :func:`hf_distca.kernels.attention_forward`."""
    saved = take_saved_attention(q.shape[0])
    if saved is not None:
        return _replay(q, k, v, saved)
    runner = LocalRunner(cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), scale, backend)
    return _AttentionOp.apply(q, k, v, runner, None)
