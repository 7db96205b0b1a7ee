"""Signal-only exchanges: the reference that overlapping communication can at best reach.

Inside :func:`signal_only`, every all-to-all of the library (:func:`hf_distca.comm.all_to_all_v`, as each
hf_distca module that calls it holds it) sends one byte to each rank instead of its payload and returns a
zero-filled receive buffer of the right size. A step then keeps its schedule, its synchronisation between
ranks and its kernels, with (almost) free communication. The results are wrong: for benchmarks only, never
for training. The library knows nothing of it: the exchange is swapped for the duration of the block.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from hf_distca import comm, metrics


def signal_exchange(
    send: torch.Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    group: Any,
    *,
    async_op: bool = False,
    phase: str | None = None,
) -> comm.Exchange:
    """:func:`hf_distca.comm.all_to_all_v`'s signature and checks, but one byte to and from every rank
    (counted as such in :mod:`hf_distca.metrics`); the received payload reads as zeros."""
    if send.dim() != 1 or sum(send_splits) != send.numel():
        raise ValueError(f"a flat buffer of {sum(send_splits)} elements expected, got {tuple(send.shape)}")
    world = len(recv_splits)
    flags = torch.zeros(2 * world, dtype=torch.uint8, device=send.device)  # [sent | received]
    work = dist.all_to_all_single(flags[world:], flags[:world], group=group, async_op=async_op)
    metrics.record_bytes(world, world, phase)
    recv = send.new_zeros(sum(recv_splits))
    return comm.Exchange(recv=recv, send=flags, work=work if async_op else None)


@contextlib.contextmanager
def signal_only() -> Iterator[None]:
    """Inside, every loaded hf_distca module's ``all_to_all_v`` is :func:`signal_exchange`; restored on exit
    (nested blocks leave it to the outermost)."""
    real = comm.all_to_all_v
    holders = [
        module
        for name, module in list(sys.modules.items())
        if name.split(".")[0] == "hf_distca" and getattr(module, "all_to_all_v", None) is real
    ]
    for module in holders:
        module.all_to_all_v = signal_exchange
    try:
        yield
    finally:
        for module in holders:
            module.all_to_all_v = real
