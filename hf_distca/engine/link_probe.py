"""The link probe: measure the all-to-all bandwidth the planner prices moves with
(``DistCAConfig(measure_link=True)``), once per process group, at an explicit point before the first
engine call (:func:`hf_distca.engine.probes.probe`, which :func:`hf_distca.enable_distca` calls); the
engine reads the figure from its state and never measures inside a layer's call.

Every rank runs the same three collectives at the same point (:func:`probe_link`): a warm-up
all-to-all (NCCL opens its peer connections lazily), the timed all-to-all of ``PROBE_BYTES`` per rank,
spread over the rank's peers (the ranks in other nodes when ``ranks_per_node`` is set and there are any,
else every other rank), and an all-reduce (MAX) of the timed seconds, so that every rank prices with the
same figure: the slowest rank's, as every all-to-all of the engine waits for it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.distributed as dist

from hf_distca.comm import collective_device, group_rank_world
from hf_distca.config import DistCAConfig
from hf_distca.engine.state import EngineState, engine_state, group_key
from hf_distca.planning.traffic import INTER, link_classes

PROBE_BYTES = 8 * 2**20
"""Bytes one rank sends in the timed all-to-all (16 MiB and up reach 140-307 GiB/s on NVLink; smaller
messages are latency-bound, so the probe's figure is a conservative one)."""


def peers(rank: int, world: int, ranks_per_node: int | None) -> list[int]:
    """The ranks ``rank`` sends probe bytes to: those in other nodes when there are any, else all others."""
    others = [r for r in range(world) if r != rank]
    if ranks_per_node is None:
        return others
    remote = [r for r in others if link_classes(r, rank, ranks_per_node) == INTER]
    return remote or others


def probe_splits(rank: int, world: int, ranks_per_node: int | None) -> tuple[list[int], list[int]]:
    """Bytes ``rank`` sends to and receives from each rank in the timed all-to-all: ``PROBE_BYTES`` over
    its own peers, and from each peer what that peer sends it (its ``PROBE_BYTES`` over the peer's own
    peers: with nodes of unequal size the two differ, e.g. 12 ranks in nodes of 8 and 4)."""

    def sent_by(r: int) -> list[int]:
        targets = peers(r, world, ranks_per_node)
        return [PROBE_BYTES // len(targets) if t in targets else 0 for t in range(world)]

    return sent_by(rank), [sent_by(r)[rank] for r in range(world)]


def measure_link_gib_per_s(group: Any, device: torch.device, ranks_per_node: int | None) -> float:
    """GiB/s of one rank's all-to-all to its :func:`peers`, the same on every rank (collective)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dev = collective_device(group, device)
    send_splits, recv_splits = probe_splits(rank, world, ranks_per_node)
    send = torch.ones(sum(send_splits), dtype=torch.uint8, device=dev)
    recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=dev)

    def exchange() -> None:
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    exchange()  # warm-up: connections
    start = time.perf_counter()
    exchange()
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=dev)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
    return sum(send_splits) / float(seconds.item()) / 2**30


def probe_link(
    config: DistCAConfig, group: Any, device: torch.device, state: EngineState | None = None
) -> float | None:
    """Measure ``group``'s link when ``config`` asks for it (``measure_link``, no given figure, several
    ranks) and it was not measured yet, into ``state`` (None: the process's); returns the figure (None
    when not asked for). Collective on ``group`` when it measures: call it on every rank together."""
    state = state if state is not None else engine_state()
    if not config.measure_link or config.link_gib_per_s is not None or group_rank_world(group)[1] == 1:
        return None
    key = group_key(group)
    if key not in state.link_gib_per_s:
        state.link_gib_per_s[key] = measure_link_gib_per_s(group, device, config.ranks_per_node)
    return state.link_gib_per_s[key]


def with_measured_link(config: DistCAConfig, group: Any, state: EngineState | None = None) -> DistCAConfig:
    """``config`` with ``link_gib_per_s`` as :func:`probe_link` measured it on ``group`` when it asks for
    it (``measure_link`` and no given figure). Never collective: raises when the probe has not run."""
    if not config.measure_link or config.link_gib_per_s is not None:
        return config
    measured = measured_link_gib_per_s(group, state)
    if measured is None:
        raise RuntimeError(
            "DistCAConfig(measure_link=True) but the link of this process group was not measured: the probe is "
            "collective and runs before the first engine call, at hf_distca.enable_distca(model, group=...) or "
            "hf_distca.engine.probe(config, group=..., device=...), on every rank; or give link_gib_per_s"
        )
    return dataclasses.replace(config, link_gib_per_s=measured)


def measured_link_gib_per_s(group: Any, state: EngineState | None = None) -> float | None:
    """The figure measured on ``group`` (None before :func:`probe_link` measured it)."""
    state = state if state is not None else engine_state()
    return state.link_gib_per_s.get(group_key(group))
