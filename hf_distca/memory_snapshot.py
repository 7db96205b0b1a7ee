"""The peak of a training step from the CUDA caching allocator's own record: every block allocated at the
peak, grouped by the code that allocated it.

:class:`PeakRecorder` turns on the allocator's history (``torch.cuda.memory._record_memory_history``, the
recorder behind PyTorch's memory visualizer) for one step, takes its snapshot, and :func:`peak_breakdown`
replays the recorded allocations and frees to find the moment of the largest allocated total and what
was live then. Blocks allocated before the recording started (the weights, what earlier steps left) are
one group, "before the recording" (or their frames' groups, where the snapshot recorded their allocation):
the total at the start is what the snapshot's live blocks hold minus the net of the recorded events, frees
of those earlier blocks included, so one freed during the window counts until its free. The replayed peak
is checked against ``torch.cuda.max_memory_allocated`` over the same window, so a breakdown that does not
add up says so (``unaccounted_gib``: the allocator's rounding of the blocks, at least).

Each block is grouped under the innermost frame of its Python stack that belongs to a library doing the
work (hf_distca, Transformers' models, liger-kernel, torch's checkpoint and autograd functions), so the
groups read as "Llama's RMSNorm", "the engine's dispatch", "the offload's bring-back".
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from itertools import islice
from typing import Any

import torch

__all__ = ["PeakRecorder", "peak_breakdown"]

GIB = 2**30
OWNING_CODE = (
    "hf_distca/",
    "transformers/models/",
    "transformers/modeling_",
    "transformers/loss/",
    "liger_kernel/",
    "torch/utils/checkpoint",
    "torch/autograd/",
    "torch/nn/functional",
    "accelerate/",
    "transformers/trainer",
)
"""Where a frame must be to name a block's group (the innermost such frame wins)."""


def _group(frames: list[dict]) -> str:
    for frame in frames:  # innermost first
        name = frame.get("filename", "")
        for part in OWNING_CODE:
            at = name.find(part)
            if at >= 0:
                return f"{name[at:]}:{frame.get('line')} {frame.get('name')}"
    return (
        "(no Python frame: autograd's backward or a C++ allocation)"
        if not frames
        else (f"{frames[0].get('filename', '?')}:{frames[0].get('line')} {frames[0].get('name')}")
    )


def _free_action(events: list[dict]) -> str:
    """The event at which a block stops counting as allocated: ``free_requested``, where the allocator
    lowers its allocated total (what ``max_memory_allocated`` follows; the block may still wait on other
    streams), or ``free_completed`` where the history skipped the requests (``skip_actions``)."""
    return "free_requested" if any(e["action"] == "free_requested" for e in events) else "free_completed"


@dataclass
class _Replay:
    """The allocated total replayed over a prefix of a trace, relative to the start of the recording."""

    live: dict[int, int]
    """addr -> index of its ``alloc`` event, for each block allocated in the trace and live now."""
    delta: int
    """Bytes allocated now minus at the start: recorded allocs minus every counted free."""
    freed_before: int
    """Bytes of the blocks allocated before the recording and freed by now (part of ``delta``)."""
    high: int
    """The largest ``delta`` so far (0: the start itself)."""
    high_at: int
    """The index of the event that first reached ``high`` (-1: the start)."""


def _replay(events: list[dict], stop: int, free_action: str) -> _Replay:
    """Replay ``events[:stop]``: one pass, dictionary work per event (no copies), so long traces stay linear."""
    live: dict[int, int] = {}
    delta = freed_before = high = 0
    high_at = -1
    for i, event in enumerate(islice(events, stop)):
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = i
            delta += event["size"]
            if delta > high:  # strict: the first moment of the peak
                high, high_at = delta, i
        elif action == free_action:
            at = live.pop(event["addr"], None)
            if at is None:
                # never allocated in the trace: a block from before the recording, in the start total
                # exactly once (its one free_action event), leaving it now
                freed_before += event["size"]
                delta -= event["size"]
            else:
                delta -= events[at]["size"]
        # the other free action (free_completed after a counted free_requested), segment and oom events
        # change nothing allocated
    return _Replay(live, delta, freed_before, high, high_at)


def peak_breakdown(snapshot: dict, device: int = 0, top: int = 40) -> dict[str, Any]:
    """The peak of the allocated total over ``snapshot``'s recorded events on ``device`` and the live blocks
    then, by group (GiB, largest first, the first ``top``; the rest summed).

    The total at the start of the recording is what the snapshot's live blocks hold minus the net of the
    events, so a block allocated before the recording counts from the start whether it is still live at the
    end or freed in the trace (a free of an address the trace never allocated). Two passes: the first finds
    the peak's event, the second replays up to it for the blocks live then. Sizes are the requested bytes
    the trace records (``requested_size`` of the snapshot's blocks); ``max_memory_allocated`` counts the
    allocator's rounded blocks, a little more.
    """
    events = snapshot["device_traces"][device]
    free_action = _free_action(events)
    whole = _replay(events, len(events), free_action)
    at_end = [
        block
        for segment in snapshot["segments"]
        if segment.get("device", device) == device
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
    ]
    # the replay ends at what the snapshot holds: start + whole.delta == the live blocks' bytes
    start = sum(block.get("requested_size", block["size"]) for block in at_end) - whole.delta
    peak = start + whole.high
    at_peak = _replay(events, whole.high_at + 1, free_action)
    groups: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for i in at_peak.live.values():
        event = events[i]
        group = _group(event.get("frames", []))
        groups[group] += event["size"] / GIB
        counts[group] += 1
    # blocks from before the recording still live at the end were live at the peak too: those whose
    # allocation the snapshot recorded (frames, with an address the trace did not allocate) go by their frames
    before = start - at_peak.freed_before
    for block in at_end:
        if block.get("frames") and "address" in block and block["address"] not in whole.live:
            size = block.get("requested_size", block["size"])
            group = _group(block["frames"])
            groups[group] += size / GIB
            counts[group] += 1
            before -= size
    # invariant: before + the groups' bytes == peak (each live block at the peak counted once)
    ranked = sorted(groups.items(), key=lambda kv: -kv[1])
    out = [{"group": "before the recording", "gib": before / GIB, "blocks": None}]
    out += [{"group": g, "gib": gib, "blocks": counts[g]} for g, gib in ranked[:top]]
    rest = sum(gib for _, gib in ranked[top:])
    if rest:
        out.append({"group": f"{len(ranked) - top} more groups", "gib": rest, "blocks": None})
    return {
        "peak_gib": peak / GIB,
        "events": len(events),
        "peak_event": whole.high_at if whole.high_at >= 0 else None,
        "start_gib": start / GIB,
        "groups": out,
    }


class PeakRecorder:
    """Records the CUDA allocator's history between :meth:`start` and :meth:`stop` (one training step,
    say) and breaks its peak down (:func:`peak_breakdown`). ``max_entries``: the history's ring buffer; a
    window with more events than that loses its first ones, which :meth:`stop` refuses to report on."""

    def __init__(self, max_entries: int = 2_000_000) -> None:
        self.max_entries = max_entries
        self.report: dict[str, Any] | None = None

    def start(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=self.max_entries, stacks="python")

    def stop(self, path: str | None = None) -> dict[str, Any]:
        """The breakdown of the window's peak (also written to ``path`` as JSON)."""
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() / GIB
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        device = torch.cuda.current_device()
        events = len(snapshot["device_traces"][device])
        if events >= self.max_entries:
            raise RuntimeError(
                f"PeakRecorder: {events} allocator events filled the history of {self.max_entries}: the first "
                "ones are lost and the peak cannot be replayed; give a larger max_entries"
            )
        report = peak_breakdown(snapshot, device)
        report["max_memory_allocated_gib"] = measured
        report["unaccounted_gib"] = measured - report["peak_gib"]
        self.report = report
        if path is not None:
            with open(path, "w") as f:
                json.dump(report, f, indent=2)
        return report


def peak_step_callback(step: int, path: str):
    """A Transformers ``TrainerCallback`` that records optimizer step ``step`` (1-based) with a
    :class:`PeakRecorder` and writes its breakdown to ``path``."""
    from transformers import TrainerCallback

    class PeakStep(TrainerCallback):
        def __init__(self) -> None:
            self.recorder = PeakRecorder()

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == step - 1:
                self.recorder.start()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                self.recorder.stop(path)

    return PeakStep()
