"""Collectives: all-to-all-v of flat buffers (the only collective in the per-layer path of the engine) and
the small all-gathers of set-up and metrics (:func:`all_gather_rows`, :func:`all_gather_padded`).

Explicit and outside autograd: the engine's operator calls it in forward and backward and decides
what travels. The process group is always passed in. With ``async_op=True`` the exchange is only
started; :meth:`Exchange.wait` completes it, so a schedule can run other work in between.
Every byte sent and received is counted in :mod:`hf_distca.metrics` when the exchange starts.

On CUDA (NCCL) an asynchronous exchange runs on the process group's own communication stream: starting it
orders that stream after the work already queued on the current stream (an event), and ``wait()`` orders
the current stream after the exchange (an event again, the host does not block); so the kernels queued
in between overlap the transfer. On the CPU (gloo) the exchange runs on gloo's worker threads and
``wait()`` blocks the host until it is done: the same schedule, so the same ordering logic runs in CI.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hf_distca import metrics


def group_rank_world(group: Any) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size (0, 1 without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("a process group was passed but torch.distributed is not initialized")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def bound_device(group: Any) -> torch.device | None:
    """The device ``group`` (None: the world) is bound to (``init_process_group(device_id=...)``, public as
    the process group's ``bound_device_id``); None when it is not bound (gloo, or no ``device_id``)."""
    pg = dist.group.WORLD if group is None else group
    return getattr(pg, "bound_device_id", None)


def collective_device(group: Any, device: torch.device) -> torch.device:
    """Where a collective on ``group`` wants its tensors (CUDA for NCCL, the CPU for gloo).

    NCCL: ``device`` when it is a CUDA device, else the group's bound device (the device fixed once at
    ``init_process_group(device_id=...)``), else the current CUDA device. Refuses a current CUDA device other
    than the bound one: a collective on the wrong device hangs or fails inside NCCL."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        bound = bound_device(group)
        current = torch.cuda.current_device()
        if bound is not None and bound.index is not None and bound.index != current:
            raise RuntimeError(
                f"the process group is bound to {bound} (init_process_group(device_id=...)) but this process's "
                f"current CUDA device is cuda:{current}; call torch.cuda.set_device({bound.index}) before "
                "training (Accelerate and torchrun recipes set it from LOCAL_RANK), or bind the group to the "
                "device the process uses"
            )
        if device.type == "cuda":
            return device
        return bound if bound is not None else torch.device("cuda", current)
    if backend == "gloo":
        return torch.device("cpu")
    return device


def all_gather_rows(
    row: list, group: Any = None, device: torch.device | None = None, dtype: torch.dtype = torch.int64
) -> list[list]:
    """Every rank's equal-length ``row`` of numbers in rank order (one all-gather, one host synchronisation;
    ``[row]`` on one process or without torch.distributed)."""
    _, world = group_rank_world(group)
    if world == 1:
        return [list(torch.tensor(row, dtype=dtype).tolist())]
    mine = torch.tensor(row, dtype=dtype, device=collective_device(group, device or torch.device("cpu")))
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    return torch.stack(everyone).cpu().tolist()


def all_gather_padded(
    x: torch.Tensor, counts: list[int], group: Any, device: torch.device | None = None
) -> list[torch.Tensor]:
    """Every rank's ``x`` (``counts[r]`` rows on rank r, the same trailing shape), in rank order: padded to
    ``max(counts)`` rows for one all-gather (on ``device``, default x's), then cut back."""
    if len(counts) == 1:  # a single process: nothing to gather (works without torch.distributed)
        return [x]
    padded = x.new_zeros((max(max(counts), 1), *x.shape[1:]), device=device or x.device)
    padded[: x.shape[0]] = x
    gathered = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(gathered, padded.contiguous(), group=group)
    return [g[:n] for g, n in zip(gathered, counts, strict=True)]


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


@dataclass
class Chain:
    """All-to-all-v exchanges that run one after the other (the KV relay's two stages), each started from
    what the one before it received; ``wait()`` returns every stage's received buffer, in order."""

    exchanges: list[Exchange]
    started: Any = None
    """On CUDA, an event on the side stream once it has started the later stages (the first stage waited
    for there); None on the CPU or with one stage."""

    def wait(self) -> list[torch.Tensor]:
        if self.started is not None:  # this chain's point on the side stream, not whatever came after it
            torch.cuda.current_stream(self.exchanges[0].recv.device).wait_event(self.started)
            self.started = None
            self.exchanges[0].work = None
        return [exchange.wait() for exchange in self.exchanges]


def chain(first: Exchange, then: Callable[[torch.Tensor], Exchange] | None = None, side: Any = None) -> Chain:
    """``first``, then the exchange ``then`` starts from first's received buffer. On CUDA ``then`` runs on
    ``side`` (a CUDA stream of first's device, the caller's to own) after it waits for the first stage, so
    neither the host nor the current stream waits: both stages fly back to back behind whatever the
    current stream runs meanwhile. On the CPU the host waits for the first stage before starting the
    second (gloo has no streams). Either way every rank starts the stages at the same point of its
    program, as collectives must."""
    if then is None:
        return Chain([first])
    if not first.recv.is_cuda:
        return Chain([first, then(first.wait())])
    if side is None:
        raise ValueError("chain: a CUDA chain needs the side stream its later stage runs on (side=)")
    device = first.recv.device
    current = torch.cuda.current_stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        if first.work is not None:
            first.work.wait()  # the side stream waits for the first stage, not the host
        second = then(first.recv)
        started = torch.cuda.Event()
        started.record(side)
    # both buffers were made on the side stream and are released after a wait on the current one: their
    # memory is reused only once the current stream has passed that point
    second.recv.record_stream(current)
    second.send.record_stream(current)
    return Chain([first, second], started)


def check_send(send: torch.Tensor, send_splits: list[int]) -> None:
    """Refuse a send buffer :func:`all_to_all_v` cannot send: not 1-D, or not ``sum(send_splits)`` elements."""
    if send.dim() != 1:
        raise ValueError(f"all_to_all_v sends a flat buffer, got shape {tuple(send.shape)}")
    if sum(send_splits) != send.numel():
        raise ValueError(
            f"send splits sum to {sum(send_splits)} but the buffer holds {send.numel()} elements"
        )


def all_to_all_v(
    send: torch.Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    group: Any,
    *,
    async_op: bool = False,
    phase: str | None = None,
) -> Exchange:
    """Send ``send_splits[r]`` elements of the 1-D buffer ``send`` to rank r of ``group`` and receive
    ``recv_splits[r]`` elements from it (in rank order). Every rank of the group must call it with
    matching splits. Not differentiable. ``phase``: the name its bytes are counted under in
    :mod:`hf_distca.metrics` (the engine's phases of the traffic ledger)."""
    check_send(send, send_splits)
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
    elem = send.element_size()
    metrics.record_bytes(sum(send_splits) * elem, sum(recv_splits) * elem, phase)
    return Exchange(recv=recv, send=send, work=work if async_op else None)
