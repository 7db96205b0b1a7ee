"""All-to-all-v of flat buffers: the only collective in the per-layer path of the engine.

Explicit and outside autograd: the engine's operator calls it in forward and backward and decides
what travels. The process group is always passed in. With ``async_op=True`` the exchange is only
started; :meth:`Exchange.wait` completes it, so a schedule can run other work in between.
Every byte sent and received is counted in :mod:`hf_distca.metrics` when the exchange starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hf_distca import metrics


@dataclass
class Exchange:
    """An all-to-all-v in flight (or done). ``wait()`` returns the received flat buffer."""

    recv: torch.Tensor
    send: torch.Tensor
    """Kept alive until the exchange completes (the collective reads it asynchronously)."""
    work: Any = None
    """The collective's handle while it is in flight; None once complete."""

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
            self.send = self.recv[:0]
        return self.recv


def all_to_all_v(
    send: torch.Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    group: Any,
    *,
    async_op: bool = False,
) -> Exchange:
    """Send ``send_splits[r]`` elements of the 1-D buffer ``send`` to rank r of ``group`` and receive
    ``recv_splits[r]`` elements from it (in rank order). Every rank of the group must call it with
    matching splits. Not differentiable."""
    if send.dim() != 1:
        raise ValueError(f"all_to_all_v sends a flat buffer, got shape {tuple(send.shape)}")
    if sum(send_splits) != send.numel():
        raise ValueError(
            f"send splits sum to {sum(send_splits)} but the buffer holds {send.numel()} elements"
        )
    send = send.contiguous()
    recv = send.new_empty(sum(recv_splits))
    work = dist.all_to_all_single(
        recv,
        send,
        output_split_sizes=list(recv_splits),
        input_split_sizes=list(send_splits),
        group=group,
        async_op=async_op,
    )
    metrics.record_bytes_sent(sum(send_splits) * send.element_size())
    metrics.record_bytes_received(sum(recv_splits) * send.element_size())
    return Exchange(recv=recv, send=send, work=work if async_op else None)
