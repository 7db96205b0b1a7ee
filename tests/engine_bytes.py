"""What the engine's byte counters must show, from the traffic ledger (hf_distca.planning.traffic)."""

from __future__ import annotations

import numpy as np

from hf_distca.planning import traffic


def exchange_bytes(q_out: int, kv_out: int, q_in: int, kv_in: int, q_row: int, kv_row: int) -> dict[str, int]:
    """Bytes one engine call moves for a rank that sends ``q_out`` / ``kv_out`` query / KV rows to servers
    and serves ``q_in`` / ``kv_in`` rows for other ranks (q_row: bytes of one query, output or gradient
    row; kv_row: bytes of one token's key plus value): the ledger's forward and backward phases."""
    per_phase = traffic.phase_bytes(np.array([q_out * q_row, kv_out * kv_row, q_in * q_row, kv_in * kv_row]))
    fwd = traffic.forward_phases()  # per_phase: (phases, 2) [sent, received]
    return {
        "fwd_sent": int(per_phase[fwd, 0].sum()),
        "fwd_recv": int(per_phase[fwd, 1].sum()),
        "bwd_sent": int(per_phase[~fwd, 0].sum()),
        "bwd_recv": int(per_phase[~fwd, 1].sum()),
    }


def phase_counts(ledger: np.ndarray, rank: int, forwards: int, backwards: int) -> dict[str, list[int]]:
    """Per phase, the [sent, received] bytes the engine's counters must show for ``rank`` after
    ``forwards`` forward and ``backwards`` backward calls, from the ledger's ``plan_bytes`` (phases, ranks,
    2); phases that move nothing for the rank are left out (the counters may not list them)."""
    out = {}
    for p, (name, fwd) in enumerate(zip(traffic.PHASES, traffic.forward_phases(), strict=True)):
        calls = forwards if fwd else backwards
        if calls and ledger[p, rank].any():
            out[name] = [calls * int(x) for x in ledger[p, rank]]
    return out


def nonzero(counts: dict[str, list[int]]) -> dict[str, list[int]]:
    """The engine's per-phase counters without the phases that moved nothing."""
    return {k: v for k, v in counts.items() if any(v)}
