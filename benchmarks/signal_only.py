"""Signal-only exchanges: the reference that overlapping communication can at best reach.

Inside :func:`signal_only`, every all-to-all of the library (:func:`hf_distca.comm.all_to_all_v`, as each
hf_distca module that calls it holds it) sends one byte to each rank instead of its payload and returns a
zero-filled receive buffer of the right size. A step then keeps its schedule, its synchronisation between
ranks and its kernels, with (almost) free communication. The results are wrong: for benchmarks only, never
for training. The library knows nothing of it: the exchange is swapped for the duration of the block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from typing import Any

import torch

from hf_distca import comm

_all_to_all_v = comm.all_to_all_v
"""The real exchange, taken before any :func:`signal_only` block swaps the library's for
:func:`signal_exchange` (``hf_distca.comm`` is among the modules swapped)."""


def signal_exchange(
    send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: Any, **options: Any
) -> comm.Exchange:
    """:func:`hf_distca.comm.all_to_all_v` with its checks and ``options`` (``async_op``, ``phase``), but
    exchanging one byte with every rank (counted as such in :mod:`hf_distca.metrics`); the received
    payload reads as zeros."""
    comm.check_send(send, send_splits)
    world = len(recv_splits)
    ones = [1] * world
    flags = _all_to_all_v(send.new_zeros(world, dtype=torch.uint8), ones, ones, group, **options)
    return dataclasses.replace(flags, recv=send.new_zeros(sum(recv_splits)))


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
