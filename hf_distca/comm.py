"""Differentiable all-to-all-v: the only collective in the per-layer path. The group is always passed in."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hf_distca import metrics


class _AllToAllV(torch.autograd.Function):
    """Forward: send ``send_splits[r]`` elements of a flat buffer to rank r and receive
    ``recv_splits[r]`` from it. Backward: the same exchange with the splits swapped."""

    @staticmethod
    def forward(
        ctx, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group
    ) -> torch.Tensor:
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        return _exchange(send, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.recv_splits, ctx.send_splits, ctx.group), None, None, None


def _exchange(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    recv = send.new_empty(sum(recv_splits))
    dist.all_to_all_single(
        recv, send.contiguous(), output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group
    )
    metrics.record_bytes_sent(sum(send_splits) * send.element_size())
    metrics.record_bytes_received(sum(recv_splits) * send.element_size())
    return recv


def all_to_all_v(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """Exchange slices of the 1-D tensor ``send`` with every rank of ``group`` (differentiable)."""
    if send.dim() != 1:
        raise ValueError(f"all_to_all_v sends a flat buffer, got shape {tuple(send.shape)}")
    if sum(send_splits) != send.numel():
        raise ValueError(
            f"send splits sum to {sum(send_splits)} but the buffer holds {send.numel()} elements"
        )
    return _AllToAllV.apply(send, list(send_splits), list(recv_splits), group)
