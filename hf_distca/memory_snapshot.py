"""The peak of a training step from the CUDA caching allocator's own record: every block allocated at the
peak, grouped by the code that allocated it.

:class:`PeakRecorder` turns on the allocator's history (``torch.cuda.memory._record_memory_history``, the
recorder behind PyTorch's memory visualizer) for one step, takes its snapshot, and :func:`peak_breakdown`
replays the recorded allocations and frees to find the moment of the largest allocated total and what
was live then. Blocks allocated before the recording started (the weights, what earlier steps left) are
one group, "before the recording": their total is what the snapshot's live blocks hold minus the net of the
recorded events. The replayed peak is checked against ``torch.cuda.max_memory_allocated`` over the same
window, so a breakdown that does not add up says so (``unaccounted_gib``).

Each block is grouped under the innermost frame of its Python stack that belongs to a library doing the
work (hf_distca, Transformers' models, liger-kernel, torch's checkpoint and autograd functions), so the
groups read as "Llama's RMSNorm", "the engine's dispatch", "the offload's bring-back".
"""

from __future__ import annotations

import json
from collections import defaultdict
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


def peak_breakdown(snapshot: dict, device: int = 0, top: int = 40) -> dict[str, Any]:
    """The peak of the allocated total over ``snapshot``'s recorded events on ``device`` and the live blocks
    then, by group (GiB, largest first, the first ``top``; the rest summed)."""
    events = snapshot["device_traces"][device]
    live_now = sum(
        block["size"]
        for segment in snapshot["segments"]
        if segment.get("device", device) == device
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
    )
    live: dict[int, tuple[int, str]] = {}
    net = 0
    for event in events:  # first pass: the net of the recorded events
        action, addr, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[addr] = (size, "")
            net += size
        elif action in ("free_requested", "free_completed") and addr in live:
            net -= live.pop(addr)[0]
    before = live_now - net  # allocated before the recording and still live at its start
    total, peak, peak_live = before, before, {}
    live = {}
    for event in events:
        action, addr, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[addr] = (size, _group(event.get("frames", [])))
            total += size
            if total > peak:
                peak, peak_live = total, dict(live)
        elif action in ("free_requested", "free_completed") and addr in live:
            total -= live.pop(addr)[0]
    groups: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for size, group in peak_live.values():
        groups[group] += size / GIB
        counts[group] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1])
    out = [{"group": "before the recording", "gib": before / GIB, "blocks": None}]
    out += [{"group": g, "gib": gib, "blocks": counts[g]} for g, gib in ranked[:top]]
    rest = sum(gib for _, gib in ranked[top:])
    if rest:
        out.append({"group": f"{len(ranked) - top} more groups", "gib": rest, "blocks": None})
    return {"peak_gib": peak / GIB, "events": len(events), "groups": out}


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
