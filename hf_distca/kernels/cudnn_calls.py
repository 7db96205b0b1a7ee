"""Host-side planning of the cudnn backend's kernel calls: which sequences run in which cuDNN launch,
with which mask alignment and at which rows (why: :mod:`hf_distca.kernels.cudnn_backend`), and the shape
ladder plans are built on. Pure Python: testable without a GPU."""

from __future__ import annotations

from dataclasses import dataclass, replace

from hf_distca.kernels.common import PackedSeqs

__all__ = [
    "BOTTOM_RIGHT",
    "FULL",
    "SUFFIX_STRATEGIES",
    "TOP_LEFT",
    "KernelCall",
    "bucket",
    "check_strategy",
    "packed_starts",
    "plan_calls",
    "split_call",
]

SUFFIX_STRATEGIES = ("bottom_right", "split")
"""How suffix sequences (len_q < len_k) run: one bottom-right causal call, or split in two parts."""
TOP_LEFT, BOTTOM_RIGHT, FULL = "causal_top_left", "causal_bottom_right", "full"
"""A call's mask: causal aligned top-left or bottom-right, or non-causal."""


def check_strategy(strategy: str) -> None:
    if strategy not in SUFFIX_STRATEGIES:
        raise ValueError(f"suffix_strategy must be one of {SUFFIX_STRATEGIES}, got {strategy!r}")


@dataclass(frozen=True)
class KernelCall:
    """One cuDNN launch over several sequences with one mask. Row offsets index the packed tensors."""

    mask: str
    """TOP_LEFT, BOTTOM_RIGHT or FULL (non-causal)."""
    q_rows: tuple[int, ...]
    """First query row of each sequence in q (also where its out/dout/lse rows are in the backward)."""
    k_rows: tuple[int, ...]
    """First key row of each sequence in k and v (and dk, dv)."""
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    out_rows: tuple[int, ...]
    """First row of each sequence's partial output (forward out/lse, backward dq) in the call's target
    buffer: the shared output (== q_rows) or a compact side buffer."""
    side: bool
    """Whether the call writes out/lse (forward) and dq (backward) to compact side buffers."""
    window: int | None = None
    """Sliding window of the causal masks (None: full causal)."""

    @property
    def num_seqs(self) -> int:
        return len(self.q_rows)


def plan_calls(seqs: PackedSeqs, strategy: str) -> tuple[KernelCall, ...]:
    """Group the sequences of one kernel call by mask alignment (see :mod:`hf_distca.kernels.cudnn_backend`).

    Calls come in the order they must run: the top-left call, then the bottom-right one, then the
    non-causal side call of a split (its backward adds onto the dq the top-left call wrote).
    """
    check_strategy(strategy)
    prefix: list[tuple[int, int, int, int, int]] = []  # (q_row, k_row, lq, lk, out_row)
    suffix: list[tuple[int, int, int, int, int]] = []
    rest: list[tuple[int, int, int, int, int]] = []  # split: non-causal parts, out rows in the side buffer
    side_rows = 0
    for i in range(seqs.num_seqs):
        q0, k0, lq, lk = seqs.q_bounds[i], seqs.k_bounds[i], seqs.q_len(i), seqs.k_len(i)
        if lq == 0:
            continue
        if lq == lk:
            prefix.append((q0, k0, lq, lk, q0))
        elif strategy == "bottom_right" or seqs.window is not None:
            suffix.append((q0, k0, lq, lk, q0))
        else:
            prefix.append((q0, k0 + lk - lq, lq, lq, q0))  # causal square over the last lq keys
            rest.append((q0, k0, lq, lk - lq, side_rows))  # every query sees every earlier key
            side_rows += lq

    def call(mask: str, rows: list[tuple[int, int, int, int, int]], side: bool) -> KernelCall:
        q_rows, k_rows, q_lens, k_lens, out_rows = (tuple(col) for col in zip(*rows))
        return KernelCall(mask, q_rows, k_rows, q_lens, k_lens, out_rows, side, seqs.window)

    calls = []
    if prefix:
        calls.append(call(TOP_LEFT, prefix, False))
    if suffix:
        calls.append(call(BOTTOM_RIGHT, suffix, False))
    if rest:
        calls.append(call(FULL, rest, True))
    return tuple(calls)


def packed_starts(lengths: tuple[int, ...]) -> tuple[int, ...]:
    """Start rows of sequences of these lengths laid out back to back from row 0."""
    starts, row = [], 0
    for n in lengths:
        starts.append(row)
        row += n
    return tuple(starts)


def bucket(n: int, minimum: int) -> int:
    """Round up on a ladder with 4 steps per octave (<= 25% over n), never below ``minimum``."""
    if n <= minimum:
        return minimum
    step = max(1, (1 << (n.bit_length() - 1)) // 4)
    return -(-n // step) * step


def split_call(call: KernelCall, max_rows: int) -> tuple[KernelCall, ...]:
    """``call`` as runs of consecutive whole sequences of at most ``max_rows`` query rows and at most
    ``max_rows`` key rows each (a longer sequence runs alone), one launch each: the sequences of a call
    are independent, so the runs' results are the call's. ``max_rows`` <= 0: the call as it is."""
    if max_rows <= 0:
        return (call,)
    runs, first, rows, keys = [], 0, 0, 0
    for i in range(call.num_seqs):
        if i > first and (rows + call.q_lens[i] > max_rows or keys + call.k_lens[i] > max_rows):
            runs.append(_run(call, first, i))
            first, rows, keys = i, 0, 0
        rows += call.q_lens[i]
        keys += call.k_lens[i]
    runs.append(_run(call, first, call.num_seqs))
    return tuple(runs)


def _run(call: KernelCall, start: int, stop: int) -> KernelCall:
    return replace(
        call,
        q_rows=call.q_rows[start:stop],
        k_rows=call.k_rows[start:stop],
        q_lens=call.q_lens[start:stop],
        k_lens=call.k_lens[start:stop],
        out_rows=call.out_rows[start:stop],
    )
