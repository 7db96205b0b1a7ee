"""``kept_attention="auto"``'s second look: measured in the first step, applied from the second.

Before the first step :func:`hf_distca.kept_attention.choose_kept_attention` places each layer's kept
attention outputs by memory alone: the last layers on the device, the ones before in host memory, the first
dropped. Host memory is free of cost only while the side-stream copies hide behind compute; where they do not
(short documents: little attention, many bytes; a host link shared by the node's GPUs), dropping the
outputs and recomputing the attention in backward is cheaper. During the first training step a
:class:`LayerTimer` records CUDA events around every checkpointed decoder layer's forward and around its
core attention calls; :func:`copy_seconds` times one pinned copy each way; :func:`weigh_host_against_drop`
turns a host layer into a dropped one where its copies would cost more than recomputing its attention.
Every rank decides alike from the ranks' mean figures (:func:`hf_distca.offloading.weigh_over_ranks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hf_distca.comm import all_gather_rows

__all__ = ["LayerTimer", "copy_seconds", "weigh_host_against_drop", "weigh_over_ranks"]


class LayerTimer:
    """CUDA events around each decoder layer's forward calls and their core attention calls, for one step.

    ``layer_events[i]`` and ``attention_events[i]`` hold (start, end) event pairs of layer ``i``; the
    attention pairs are appended by :func:`hf_distca.engine.remat.timing_attention` through the layer's
    :class:`~hf_distca.engine.remat.KeptPlacement`. Nothing synchronizes until :meth:`seconds`."""

    def __init__(self, layers: int) -> None:
        self.layer_events: list[list[tuple[torch.cuda.Event, torch.cuda.Event]]] = [[] for _ in range(layers)]
        self.attention_events: list[list[tuple[torch.cuda.Event, torch.cuda.Event]]] = [
            [] for _ in range(layers)
        ]
        self.open: dict[tuple[int, int], torch.cuda.Event] = {}  # (thread id, layer) -> its start event

    def start_layer(self, index: int, thread: int) -> None:
        """Record the start of layer ``index``'s forward on the current stream (``thread``: the caller's)."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.open[(thread, index)] = event

    def end_layer(self, index: int, thread: int) -> None:
        """Record the end of the forward :meth:`start_layer` began on the same thread."""
        start = self.open.pop((thread, index), None)
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.layer_events[index].append((start, end))

    def seconds(self) -> tuple[list[float | None], list[float | None]]:
        """Per layer: the mean seconds of one core attention forward's calls in one layer call, and of one
        layer forward call; None for a layer with nothing recorded (e.g. attention that runs inside an
        interleaved or compiled region, which is not timed). Synchronizes the device."""
        torch.cuda.synchronize()
        attention: list[float | None] = []
        layer: list[float | None] = []
        for calls, kernels in zip(self.layer_events, self.attention_events, strict=True):
            if not calls:
                attention.append(None)
                layer.append(None)
                continue
            layer.append(sum(s.elapsed_time(e) for s, e in calls) / 1e3 / len(calls))
            attention.append(
                sum(s.elapsed_time(e) for s, e in kernels) / 1e3 / len(calls) if kernels else None
            )
        return attention, layer


def copy_seconds(nbytes: int, device: torch.device, *, probe_bytes: int = 256 << 20) -> tuple[float, float]:
    """Seconds to copy ``nbytes`` from ``device`` to page-locked host memory and back, from one timed copy of
    ``min(nbytes, probe_bytes)`` each way (after one untimed warm-up), scaled linearly."""
    size = max(1, min(int(nbytes), int(probe_bytes)))
    dev = torch.empty(size, dtype=torch.uint8, device=device)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    seconds = []
    for dst, src in ((host, dev), (dev, host)):
        dst.copy_(src, non_blocking=True)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3 * nbytes / size)
    return seconds[0], seconds[1]


def weigh_host_against_drop(
    policy: Sequence[str],
    attention_s: Sequence[float | None],
    layer_s: Sequence[float | None],
    kept_copy_s: tuple[float, float],
    other_copy_s: Sequence[tuple[float, float]],
) -> list[str]:
    """The policy with each "host" layer whose copies cost more than its attention turned to "drop".

    Per layer ``i``: ``attention_s[i]`` the core attention forward of one layer call (what dropping adds to
    backward), ``layer_s[i]`` its forward (the compute a side-stream copy hides behind, in forward and,
    at least as long, in backward), ``kept_copy_s`` the (out, back) seconds of one layer call's kept
    outputs and ``other_copy_s[i]`` of what else that layer offloads on the same stream (its checkpointed
    input, or (0, 0)). A copy costs the time it runs past the compute it hides behind; keeping the outputs in
    host memory costs what their copies add to that, out and back. A layer measured as None keeps its
    choice."""
    out = list(policy)
    for i, choice in enumerate(policy):
        if choice != "host" or attention_s[i] is None or layer_s[i] is None:
            continue
        added = sum(
            max(0.0, other + kept - layer_s[i]) - max(0.0, other - layer_s[i])
            for kept, other in zip(kept_copy_s, other_copy_s[i], strict=True)
        )
        if added > attention_s[i]:
            out[i] = "drop"
    return out


_NOT_MEASURED = -1


def weigh_over_ranks(offload: Any, device: torch.device, group: Any = None) -> list[str] | None:
    """After the step an :class:`~hf_distca.offloading.ActivationOffload` timed (its ``start_timing``):
    every rank's per-layer attention and layer seconds and its copy rates, one all-gather over ``group``,
    their means given to ``offload.weigh`` (a layer not measured on some rank keeps its choice), so that
    every rank gets the same policy. Returns it; None (nothing changed) where the offload timed nothing."""
    timer, offload.timer = offload.timer, None
    if timer is None:
        return None
    attention, layer = timer.seconds()
    probe = max(offload.kept_layer_bytes, 1)
    out_s, back_s = copy_seconds(probe, device)

    def micro(x: float | None) -> int:
        return _NOT_MEASURED if x is None else round(x * 1e6)

    # seconds as integer microseconds; the copy rates as picoseconds per byte
    row = [micro(a) for a in attention] + [micro(t) for t in layer] + [round(out_s / probe * 1e12)]
    row.append(round(back_s / probe * 1e12))
    rows = all_gather_rows(row, group, device)
    layers = len(attention)

    def mean(column: int) -> float | None:
        values = [r[column] for r in rows]
        return None if _NOT_MEASURED in values else sum(values) / len(values) / 1e6

    rates = (sum(r[-2] for r in rows) / len(rows) / 1e12, sum(r[-1] for r in rows) / len(rows) / 1e12)
    return offload.weigh([mean(i) for i in range(layers)], [mean(layers + i) for i in range(layers)], rates)
