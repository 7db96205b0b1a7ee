"""Short causal depthwise convolution over documents cut across ranks, with a halo exchange.

Gated-DeltaNet layers (Qwen3-Next and relatives) run a causal depthwise convolution of kernel size K
(typically 4) over the projected q/k/v rows before the recurrence: output row t of a document reads rows
t - K + 1 .. t of the same document (zeros before the document starts). When a document is cut into pieces
over ranks, the first K - 1 rows of a piece read the last K - 1 rows before it, which can lie in one or
several earlier pieces on other ranks. The halo exchange brings exactly those rows (one all-to-all-v;
its backward sends their gradients back the same way); rows held by the same rank are read in place.

Every rank derives the same halo plan from the same ``all_pieces``; the group is always passed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist

from hf_distca.comm import all_to_all_v
from hf_distca.linear.ops.scan_plan import document_runs

__all__ = ["HaloPlan", "build_halo_plan", "causal_conv_pieces"]


@dataclass(frozen=True)
class HaloPlan:
    """One rank's view of the halo exchange of a layout for a kernel of ``kernel_size`` taps."""

    rank: int
    world_size: int
    kernel_size: int
    num_rows: int
    """This rank's local tokens (T)."""
    taps: torch.Tensor
    """(K, T) CPU long tensor: per tap j (0..K-1), per local row t, the row of the source table ``[x (T) | remote halo (R) | zero]``
    that output row t multiplies with weight tap j (document position of t minus K - 1 - j)."""
    send_rows: tuple[tuple[int, ...], ...]
    """Per peer rank: the local rows it needs, in the order it stores them (empty for this rank)."""
    recv_counts: tuple[int, ...]
    """Per peer rank: how many halo rows come from it (in rank order they fill the remote halo)."""
    any_remote: bool
    """Whether any rank of the layout needs a row from another rank (the same answer on every rank)."""


@lru_cache(maxsize=64)
def _build(all_pieces: tuple, rank: int, kernel_size: int) -> HaloPlan:
    world = len(all_pieces)
    by_doc = document_runs(all_pieces)
    halo = kernel_size - 1

    def owner(doc: int, position: int) -> tuple[int, int]:
        """(rank, local row) holding ``position`` of ``doc``."""
        for start, length, r, _, offset in by_doc[doc]:
            if start <= position < start + length:
                return r, offset + position - start
        raise AssertionError("positions before a piece are tiled by earlier pieces")

    # need[dst][src]: the rows of src that dst reads, in dst's order (local piece order, then position)
    need: list[list[list[int]]] = [[[] for _ in range(world)] for _ in range(world)]
    # where[dst][(doc, position)] -> (src, index in need[dst][src]) for positions dst reads remotely
    where: list[dict[tuple[int, int], tuple[int, int]]] = [{} for _ in range(world)]
    for dst, pieces in enumerate(all_pieces):
        for doc, start, length in pieces:
            if length <= 0:
                continue
            for position in range(max(0, start - halo), start):
                src, row = owner(doc, position)
                if src != dst and (doc, position) not in where[dst]:
                    where[dst][(doc, position)] = (src, len(need[dst][src]))
                    need[dst][src].append(row)
    counts = [len(need[rank][src]) for src in range(world)]
    base = [0]
    for n in counts:
        base.append(base[-1] + n)
    total = sum(int(p[2]) for p in all_pieces[rank])
    zero_row = total + base[-1]
    taps = torch.arange(total).repeat(kernel_size, 1)  # (K, T): tap j reads row t - (K - 1 - j) ...
    taps -= torch.arange(kernel_size - 1, -1, -1)[:, None]
    offset = 0
    for doc, start, length in all_pieces[rank]:
        doc, start, length = int(doc), int(start), int(length)
        for i in range(min(halo, length)):  # ... except the first K - 1 rows of each piece
            for j in range(kernel_size - 1 - i):
                position = start + i - (kernel_size - 1 - j)
                if position < 0:
                    taps[j, offset + i] = zero_row  # before the document starts: the conv's zero padding
                else:
                    src, row = owner(doc, position)
                    if src == rank:  # an earlier piece of the document on this rank
                        taps[j, offset + i] = row
                    else:
                        index = where[rank][(doc, position)][1]
                        taps[j, offset + i] = total + base[src] + index
        offset += length
    return HaloPlan(
        rank=rank,
        world_size=world,
        kernel_size=kernel_size,
        num_rows=total,
        taps=taps,
        send_rows=tuple(tuple(need[dst][rank]) if dst != rank else () for dst in range(world)),
        recv_counts=tuple(counts),
        any_remote=any(any(need[d][s] for s in range(world) if s != d) for d in range(world)),
    )


def build_halo_plan(all_pieces: Sequence[Sequence[Sequence[int]]], rank: int, kernel_size: int) -> HaloPlan:
    """The halo plan of ``rank`` for the layout ``all_pieces`` (index = rank; (doc_id, doc_start, length))
    and a causal kernel of ``kernel_size`` taps. Cached: every layer of a micro-batch reuses it."""
    if not 0 <= rank < len(all_pieces):
        raise ValueError(f"rank {rank} is outside the layout's {len(all_pieces)} ranks")
    if kernel_size < 1:
        raise ValueError(f"the convolution kernel needs at least one tap, got kernel_size={kernel_size}")
    key = tuple(tuple(tuple(int(x) for x in p) for p in pieces) for pieces in all_pieces)
    return _build(key, rank, int(kernel_size))


def _exchange_rows(x: torch.Tensor, rows_per_peer, counts_per_peer, group) -> torch.Tensor:
    """Send x[rows_per_peer[r]] to every rank r; return the rows received, in rank order (sum(counts), C)."""
    width = x.shape[1]
    send_index = torch.tensor([i for rows in rows_per_peer for i in rows], dtype=torch.long, device=x.device)
    send = x.index_select(0, send_index).reshape(-1)  # (rows sent * C,)
    recv = all_to_all_v(
        send,
        [len(rows) * width for rows in rows_per_peer],
        [n * width for n in counts_per_peer],
        group,
    ).wait()
    return recv.view(-1, width)  # (rows received, C)


class _HaloExchange(torch.autograd.Function):
    """x (T, C) -> (remote halo rows (R, C), a zero scalar token). Backward returns the halo gradients to
    the ranks the rows came from and adds them to the rows sent."""

    @staticmethod
    def forward(ctx, x, plan, group):
        ctx.plan, ctx.group, ctx.num_rows = plan, group, x.shape[0]
        halo = _exchange_rows(x.detach(), plan.send_rows, plan.recv_counts, group)
        return halo, x.new_zeros(())

    @staticmethod
    def backward(ctx, grad_halo, grad_token):
        plan = ctx.plan
        # the reverse exchange: halo gradients go back to their owners, which receive what they sent
        back_rows = []
        offset = 0
        for n in plan.recv_counts:
            back_rows.append(tuple(range(offset, offset + n)))
            offset += n
        grad = _exchange_rows(
            grad_halo.contiguous(), back_rows, [len(rows) for rows in plan.send_rows], ctx.group
        )
        index = torch.tensor(
            [i for rows in plan.send_rows for i in rows], dtype=torch.long, device=grad.device
        )
        grad_x = grad.new_zeros((ctx.num_rows, grad.shape[1])).index_add(0, index, grad)
        return grad_x, None, None


def causal_conv_pieces(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    pieces: Sequence[Sequence[int]],
    *,
    all_pieces: Sequence[Sequence[Sequence[int]]] | None = None,
    group=None,
) -> torch.Tensor:
    """Causal depthwise convolution of this rank's rows, every document restarting from zero padding and
    continuing across the pieces of other ranks (differentiable; collective when documents are cut).

    x: (T, C) pre-convolution rows in local piece order; weight: (C, K) (tap K - 1 multiplies the current
    row); bias: None or (C,); ``pieces``: this rank's (doc_id, doc_start, length); ``all_pieces``: every
    rank's pieces (index = rank in ``group``), all ranks of ``group`` calling this together; None: this
    rank's documents are whole (nothing is exchanged, any number of ranks). Returns (T, C) without
    activation.
    """
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(
            f"causal_conv_pieces takes x (T, C) and weight (C, K); got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    local = [tuple(int(v) for v in p) for p in pieces]
    if sum(n for _, _, n in local) != x.shape[0]:
        raise ValueError(
            f"the pieces cover {sum(n for _, _, n in local)} tokens but x holds {x.shape[0]} rows; pieces must "
            "list this rank's tokens in local order"
        )
    if all_pieces is None:
        rank, world, all_pieces = 0, 1, [local]
    elif dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    elif group is not None:
        raise RuntimeError("a process group was passed but torch.distributed is not initialized")
    else:
        rank, world = 0, 1
    if len(all_pieces) != world:
        raise ValueError(f"all_pieces lists {len(all_pieces)} ranks but the group has {world}")
    if [tuple(int(v) for v in p) for p in all_pieces[rank]] != local:
        raise ValueError(f"pieces differ from all_pieces[{rank}]: every rank must pass the same layout")
    plan = build_halo_plan(all_pieces, rank, weight.shape[1])
    x = x.to(weight.dtype)
    parts = [x]
    token = None
    if plan.any_remote:  # the same decision on every rank: all of them take part in the exchange
        halo, token = _HaloExchange.apply(x, plan, group)
        parts.append(halo)
    parts.append(x.new_zeros((1, x.shape[1])))
    table = torch.cat(parts)  # (T + R + 1, C): local rows, remote halo rows, the zero row
    out = x.new_zeros(x.shape) if bias is None else bias.to(x.dtype).expand(x.shape[0], -1)
    taps = plan.taps.to(x.device)  # (K, T)
    for j in range(plan.kernel_size):
        out = out + table.index_select(0, taps[j]) * weight[:, j]  # (T, C)
    if token is not None:
        out = out + token  # every rank runs the exchange's backward (and its collective)
    return out
