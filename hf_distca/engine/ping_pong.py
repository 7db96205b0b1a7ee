"""Ping-pong parts on this rank: the parts of a micro-batch's core attention whose exchanges and kernels
interleave (the split itself, pure NumPy: :mod:`hf_distca.planning.ping_pong`).

The engine's runner (:class:`hf_distca.engine.op.PingPongRunner`) starts every part's dispatch at once,
then runs the parts' kernels in order, each as soon as its own rows have arrived, and starts each part's
return when its kernel is done: a part's messages fly while the kernels of the parts before it (dispatch)
or after it (return) run. Without ping-pong the micro-batch is one part (:func:`whole`): the same stages,
one after the other.

Index: each part's :class:`~hf_distca.planning.DispatchIndex` comes from
:func:`~hf_distca.planning.build_dispatch_index` with ``part=True`` on the part's plan: it covers the
local rows whose queries the part computes (``computed_rows``), and the part's own streams only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from hf_distca.engine.prepare import PreparedAttention
from hf_distca.kernels import host_to_device
from hf_distca.kernels.common import int32_offsets
from hf_distca.planning import build_dispatch_index, forward_flops_per_pair
from hf_distca.planning.ping_pong import part_plans
from hf_distca.planning.relay import with_relay

__all__ = ["PartSplit", "ping_pong_parts", "whole"]


@dataclass
class PartSplit:
    """The ping-pong parts of one micro-batch on this rank, in the order their stages run."""

    parts: tuple[PreparedAttention, ...]
    """Per part, what the stages need (its own plan and index over this rank's full q, k, v)."""
    rows: tuple[np.ndarray, ...]
    """Per part, the local rows whose queries it computes (ascending); together every local row once."""
    _order: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def local_order(self, device: torch.device) -> torch.Tensor:
        """(T_local,) int64: where local row r lies in ``cat(rows)`` (puts the parts' outputs in local order)."""
        key = str(device)
        if key not in self._order:
            order = np.argsort(np.concatenate(self.rows), kind="stable")
            # through pinned memory on CUDA: the copy does not block the host
            self._order[key] = host_to_device(torch.as_tensor(order, dtype=torch.long), device)
        return self._order[key]


def whole(prepared: PreparedAttention) -> PartSplit:
    """The micro-batch as one part (the serial schedule)."""
    return PartSplit((prepared,), (np.arange(prepared.index.num_local, dtype=np.int64),))


def ping_pong_parts(prepared: PreparedAttention, shard_tokens: int, split: str = "local_first") -> PartSplit:
    """The ping-pong parts of ``prepared`` split the ``split`` way (one of PING_PONG_SPLITS,
    :func:`hf_distca.planning.ping_pong.part_plans`), computed once per prepared micro-batch and cached on it;
    ``shard_tokens``: the config's, where cuts prefer to fall."""
    key = (shard_tokens, split)
    if key in prepared.part_splits:
        return prepared.part_splits[key]
    flops_per_pair = forward_flops_per_pair(prepared.q_heads, prepared.head_dim)
    parts, rows = [], []
    for part_plan in part_plans(prepared.plan, shard_tokens, split):
        index = build_dispatch_index(part_plan, prepared.rank, part=True)
        if prepared.index.relay is not None:  # the micro-batch's KV goes through the relay: its parts' too
            index = with_relay(part_plan, index, prepared.index.relay.ranks_per_node)
        flops = [x * flops_per_pair for x in part_plan.pairs_after]
        parts.append(
            PreparedAttention(
                plan=part_plan,
                index=index,
                q_heads=prepared.q_heads,
                kv_heads=prepared.kv_heads,
                head_dim=prepared.head_dim,
                cu_seqlens_q=int32_offsets(index.cu_seqlens_q),
                cu_seqlens_k=int32_offsets(index.cu_seqlens_k),
                flops_before=flops,
                flops_after=flops,
            )
        )
        rows.append(index.computed_rows)
    prepared.part_splits[key] = PartSplit(tuple(parts), tuple(rows))
    return prepared.part_splits[key]
