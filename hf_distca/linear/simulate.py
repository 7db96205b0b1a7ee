"""Time of the cross-rank state scan at rank counts we cannot run, from a measured link model (pure Python).

Link model (alpha-beta): one point-to-point message of b bytes takes ``latency_s + b / bandwidth``; a
rank's messages to several peers in one step (one grouped ``batch_isend_irecv``) overlap their latencies
and share its bandwidth; a ring all-gather of m bytes per
rank over P ranks takes (P - 1) (latency + m / bandwidth). Fit latency and bandwidth from a ping-pong
on the real machine (``benchmarks/bench_linear_sp.py`` does) and feed them here.

For one document cut over P ranks whose chain has E edges (E = P - 1 for contiguous chunks, 2 (P - 1)
for DistCA's zigzag layout) and a state of S bytes:

- serial hand-off (LASP-1): E (alpha + S / beta)
- All-Scan with B blocks (ZeCO): (E + B - 1) (alpha + S / (B beta)); best B ~ sqrt((E - 1) S / (alpha beta))
- all-gather (LASP-2): (P - 1) (alpha + (S + A) / beta), A the transition's bytes, then a local combine.

:func:`simulate_layout` replays the real schedule of any layout (every chain, every step) instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hf_distca.linear.ops.scan_plan import build_scan_plan

__all__ = ["PointToPointLink", "best_blocks", "chain_scan_time", "fit_link", "simulate_layout"]


@dataclass(frozen=True)
class PointToPointLink:
    """A point-to-point link between two ranks."""

    latency_s: float
    """Time of an empty message (seconds)."""
    bandwidth_Bps: float
    """Bytes per second of a large message."""

    def __post_init__(self) -> None:
        if not self.latency_s >= 0:
            raise ValueError(f"PointToPointLink.latency_s must be >= 0, got {self.latency_s!r}")
        if not self.bandwidth_Bps > 0:
            raise ValueError(f"PointToPointLink.bandwidth_Bps must be > 0, got {self.bandwidth_Bps!r}")

    def message_s(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bandwidth_Bps


def fit_link(sizes_bytes: Sequence[float], times_s: Sequence[float]) -> PointToPointLink:
    """Least-squares fit of time = latency + bytes / bandwidth to one-way message times."""
    if len(sizes_bytes) != len(times_s) or len(sizes_bytes) < 2:
        raise ValueError("fit_link needs at least two (size, time) pairs of equal count")
    n = len(sizes_bytes)
    mx, my = sum(sizes_bytes) / n, sum(times_s) / n
    sxx = sum((x - mx) ** 2 for x in sizes_bytes)
    sxy = sum((x - mx) * (y - my) for x, y in zip(sizes_bytes, times_s))
    if sxx == 0 or sxy <= 0:
        raise ValueError("fit_link needs message sizes that differ and times that grow with size")
    slope = sxy / sxx
    return PointToPointLink(latency_s=max(my - slope * mx, 0.0), bandwidth_Bps=1.0 / slope)


def chain_scan_time(
    method: str,
    *,
    edges: int,
    ranks: int,
    state_bytes: float,
    transition_bytes: float,
    link: PointToPointLink,
    num_blocks: int = 1,
) -> float:
    """Seconds of one scan direction for one chain of ``edges`` hops over ``ranks`` ranks (closed form)."""
    if edges < 0 or ranks < 1:
        raise ValueError(f"edges must be >= 0 and ranks >= 1, got {edges} and {ranks}")
    if edges == 0:
        return 0.0
    if method == "serial":
        return edges * link.message_s(state_bytes)
    if method == "all_scan":
        b = max(1, num_blocks)
        return (edges + b - 1) * link.message_s(state_bytes / b)
    if method == "all_gather":
        return (ranks - 1) * link.message_s(state_bytes + transition_bytes)
    raise ValueError(f"method must be 'serial', 'all_scan' or 'all_gather', got {method!r}")


def best_blocks(edges: int, state_bytes: float, link: PointToPointLink, max_blocks: int) -> int:
    """Block count in [1, max_blocks] minimising the All-Scan time of a chain of ``edges`` hops (the
    smallest on ties; near sqrt((edges - 1) S / (alpha beta)))."""

    def seconds(b: int) -> float:
        return chain_scan_time(
            "all_scan",
            edges=edges,
            ranks=2,
            state_bytes=state_bytes,
            transition_bytes=0,
            link=link,
            num_blocks=b,
        )

    return min(range(1, max(1, max_blocks) + 1), key=lambda b: (seconds(b), b))


def simulate_layout(
    all_pieces: Sequence[Sequence[Sequence[int]]],
    *,
    method: str,
    state_bytes: float,
    transition_bytes: float,
    link: PointToPointLink,
    num_blocks: int = 1,
) -> float:
    """Seconds of one scan direction of a whole layout, replaying the schedule of
    :mod:`hf_distca.linear.ops.all_scan`: per step, each rank sends one message per peer (blocks of all
    chains concatenated) in one group: latency once, its bytes at the link's bandwidth; a step lasts as
    long as its busiest rank."""
    world = len(all_pieces)
    plans = [build_scan_plan(all_pieces, r) for r in range(world)]
    if not plans[0].has_edges:
        return 0.0
    if method == "all_gather":
        per_rank = max(plans[0].out_counts) * (state_bytes + transition_bytes)
        return (world - 1) * link.message_s(per_rank)
    blocks = 1 if method == "serial" else max(1, num_blocks)
    block_bytes = state_bytes / blocks
    total = 0.0
    for step in range(plans[0].max_chain_edges + blocks - 1):
        busiest = 0.0
        for plan in plans:
            sent = sum(
                block_bytes
                for e in plan.out_edges
                if 0 <= step - e.position < blocks and e.dst_rank != plan.rank
            )
            if sent:
                busiest = max(busiest, link.message_s(sent))
        total += busiest
    return total
