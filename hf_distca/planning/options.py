"""What the planner is told besides the pieces: balance target, split granularity, byte bounds and the
links that price communication. Pure Python; :meth:`hf_distca.config.DistCAConfig.planner_options` gives
the options of a user config (the fields keep the config's names and meanings)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BALANCE_ONLY_TOLERANCE", "PRICED_TOLERANCE", "PlannerOptions"]

BALANCE_ONLY_TOLERANCE = 0.1
"""The balance target when ``tolerance`` is None and communication is not priced (``link_gib_per_s`` None)."""
PRICED_TOLERANCE = 0.02
"""The balance target when ``tolerance`` is None and communication is priced (``link_gib_per_s`` given):
the priced planner takes a move only when it saves more than the transfer time it adds, so it can balance
tighter."""


@dataclass(frozen=True)
class PlannerOptions:
    """The planner's options; the defaults plan as ``DistCAConfig()`` does. Values are not checked here:
    the user config checks them, naming its fields."""

    tolerance: float | None = None
    """Balance target: stop once every server's cost is within (1 + tolerance) x the mean; None:
    :attr:`balance_tolerance`'s default for priced or unpriced links."""

    shard_tokens: int = 128
    """A split point inside a document sits on a multiple of this many tokens."""

    max_planner_moves: int = 100_000
    """Safety bound on greedy moves per plan."""

    max_recv_bytes_per_server: int | None = None
    """Bytes one server may receive (Q plus KV) for work moved to it; None: unbounded."""

    max_send_bytes_per_rank: int | None = None
    """Bytes one rank may send in one forward call (the plan's ``bytes_sent``); None: unbounded."""

    link_gib_per_s: float | None = None
    """All-to-all bandwidth of one rank in GiB/s between nodes (between every pair of ranks without
    ``ranks_per_node``); None: communication is not priced (the balance-only plan)."""

    intra_node_gib_per_s: float | None = None
    """All-to-all bandwidth of one rank in GiB/s inside its node; None: free."""

    ranks_per_node: int | None = None
    """Ranks [k n, (k + 1) n) share node k; None: one link class for every pair of ranks."""

    kv_relay: bool = False
    """KV rows cross nodes once per destination node, through a relay rank (:mod:`~hf_distca.planning.relay`)."""

    comm_overlap: float = 0.0
    """Fraction in [0, 1] of transfer time hidden under compute when moves are priced."""

    attention_tflops: float = 300.0
    """Forward+backward core-attention TFLOP/s that turn causal (query, key) pairs into seconds."""

    layer_seconds_per_token: float | None = None
    """Seconds per token of a layer's other work that layer-level ping-pong hides transfers behind
    (:func:`~hf_distca.planning.links.with_hiding_work`); None: no such work."""

    @property
    def balance_tolerance(self) -> float:
        """``tolerance``, or for None ``PRICED_TOLERANCE`` when communication is priced and
        ``BALANCE_ONLY_TOLERANCE`` otherwise."""
        if self.tolerance is not None:
            return self.tolerance
        return BALANCE_ONLY_TOLERANCE if self.link_gib_per_s is None else PRICED_TOLERANCE
