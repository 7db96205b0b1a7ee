"""hf_distca.memory_snapshot: the peak of a recorded window replayed from the allocator's events, on a
snapshot made by hand (the format of ``torch.cuda.memory._snapshot()``); the recipe's flag refused on the
CPU."""

from __future__ import annotations

import random
import time
from collections import defaultdict

import pytest

from hf_distca.memory_snapshot import peak_breakdown

GIB = 2**30


def _frame(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


NORM = [_frame("/x/site-packages/transformers/models/llama/modeling_llama.py", 64, "forward")]
ENGINE = [
    _frame("/x/torch/nn/modules/module.py", 1, "_call_impl"),
    _frame("/r/hf_distca/engine/stages.py", 9, "dispatch"),
]


def _snapshot(events: list[tuple], live_at_end: list[int]) -> dict:
    return {
        "device_traces": [
            [
                {"action": a, "addr": addr, "size": size * GIB, "frames": frames}
                for a, addr, size, frames in events
            ]
        ],
        "segments": [
            {"device": 0, "blocks": [{"size": s * GIB, "state": "active_allocated"} for s in live_at_end]}
        ],
    }


def test_the_peak_and_what_was_live_then_by_the_innermost_owning_frame():
    # 10 GiB live before the recording (still live at the end); the peak is 10 + 4 + 2 = 16 at the second
    # alloc; 1 GiB allocated later stays live
    events = [
        ("alloc", 1, 4, NORM),
        ("alloc", 2, 2, ENGINE[::-1]),  # innermost first: the engine's frame, then module.py
        ("free_requested", 1, 4, []),
        ("free_completed", 1, 4, []),
        ("free_requested", 2, 2, []),
        ("alloc", 3, 1, []),
    ]
    report = peak_breakdown(_snapshot(events, [10, 1]))
    assert report["peak_gib"] == pytest.approx(16)
    groups = {g["group"]: g["gib"] for g in report["groups"]}
    assert groups["before the recording"] == pytest.approx(10)
    assert groups["transformers/models/llama/modeling_llama.py:64 forward"] == pytest.approx(4)
    assert groups["hf_distca/engine/stages.py:9 dispatch"] == pytest.approx(2)
    assert sum(groups.values()) == pytest.approx(report["peak_gib"])


def test_a_peak_before_any_recorded_allocation_is_what_was_there():
    # a 3 GiB block from before the recording is freed, 5 GiB stay live: 8 were allocated at the start
    report = peak_breakdown(_snapshot([("free_requested", 7, 3, [])], [5]), top=1)
    assert report["peak_gib"] == pytest.approx(8)
    assert report["start_gib"] == pytest.approx(8)
    assert report["peak_event"] is None  # the start itself
    assert report["groups"] == [{"group": "before the recording", "gib": pytest.approx(8), "blocks": None}]


def test_frees_of_blocks_from_before_the_recording_count_until_they_happen():
    # 10 GiB from before the recording stay live; A (3 GiB, before too) is freed before the peak, B (2 GiB,
    # before too) after it, each with its free_requested and free_completed (one free, not two); the start
    # holds 10 + 3 + 2 = 15, the peak is 15 - 3 + 4 + 2 = 18 at the second alloc, with B still live
    events = [
        ("free_requested", 100, 3, []),
        ("free_completed", 100, 3, []),
        ("alloc", 1, 4, NORM),
        ("alloc", 2, 2, ENGINE[::-1]),
        ("free_requested", 200, 2, []),
        ("free_completed", 200, 2, []),
        ("free_requested", 1, 4, []),
        ("free_completed", 1, 4, []),
        ("alloc", 100, 1, NORM),  # A's address reused: a recorded block now, freed as one
        ("free_requested", 100, 1, []),
        ("free_completed", 100, 1, []),
    ]
    report = peak_breakdown(_snapshot(events, [10, 2]))
    assert report["start_gib"] == pytest.approx(15)
    assert report["peak_gib"] == pytest.approx(18)
    assert report["peak_event"] == 3
    groups = {g["group"]: g["gib"] for g in report["groups"]}
    assert groups == {
        "before the recording": pytest.approx(12),  # the 10 and B
        "transformers/models/llama/modeling_llama.py:64 forward": pytest.approx(4),
        "hf_distca/engine/stages.py:9 dispatch": pytest.approx(2),
    }


def test_without_free_requested_events_free_completed_is_the_free():
    # a history with skip_actions=["free_requested"]: the same window as above counts the same
    events = [
        ("free_completed", 100, 3, []),
        ("alloc", 1, 4, NORM),
        ("alloc", 2, 2, ENGINE[::-1]),
        ("free_completed", 200, 2, []),
        ("free_completed", 1, 4, []),
    ]
    report = peak_breakdown(_snapshot(events, [10, 2]))
    assert report["peak_gib"] == pytest.approx(18)
    assert {g["group"]: g["gib"] for g in report["groups"]}["before the recording"] == pytest.approx(12)


def test_a_free_completed_whose_request_came_before_the_recording_frees_nothing():
    # the block was already off the allocated total when the recording began (awaiting another stream)
    events = [("free_completed", 9, 3, []), ("alloc", 1, 4, NORM), ("free_requested", 1, 4, [])]
    report = peak_breakdown(_snapshot(events, [5]))
    assert report["start_gib"] == pytest.approx(5)
    assert report["peak_gib"] == pytest.approx(9)


def test_blocks_from_before_the_recording_go_by_their_frames_where_the_snapshot_has_them():
    # requested sizes throughout (the trace records them); one earlier block's allocation has frames
    events = [("alloc", 1, 4, NORM), ("free_requested", 1, 4, [])]
    snapshot = _snapshot(events, [])
    snapshot["segments"][0]["blocks"] = [
        {"address": 50, "size": 3 * GIB + 512, "requested_size": 3 * GIB, "state": "active_allocated",
         "frames": ENGINE[::-1]},
        {"address": 60, "size": 2 * GIB + 512, "requested_size": 2 * GIB, "state": "active_allocated",
         "frames": []},
        {"address": 70, "size": 7 * GIB, "requested_size": 7 * GIB, "state": "active_awaiting_free",
         "frames": NORM},
        {"address": 80, "size": 9 * GIB, "state": "inactive"},
    ]  # fmt: skip
    report = peak_breakdown(snapshot)
    assert report["peak_gib"] == pytest.approx(9)
    groups = {g["group"]: g for g in report["groups"]}
    assert groups["before the recording"]["gib"] == pytest.approx(2)
    assert groups["hf_distca/engine/stages.py:9 dispatch"]["gib"] == pytest.approx(3)
    assert groups["hf_distca/engine/stages.py:9 dispatch"]["blocks"] == 1
    assert groups["transformers/models/llama/modeling_llama.py:64 forward"]["gib"] == pytest.approx(4)


OWNERS = [[_frame(f"/r/hf_distca/model_{k}.py", k, "forward")] for k in range(12)]


def _simulated(seed: int, steps: int) -> tuple[dict, int, dict[str, int]]:
    """A random allocator run: blocks from before the recording (some never freed), allocs and frees (a
    free_requested, its free_completed a few events later), address reuse; the snapshot at the end in
    ``torch.cuda.memory._snapshot()``'s format, the true peak (bytes) and the true bytes live then by group."""
    rng = random.Random(seed)
    live: dict[int, tuple[int, str]] = {}  # addr -> (bytes, group)
    for addr in range(40):
        live[addr] = (rng.randrange(1, 1 << 20), "before the recording")
    free_addrs = list(range(40, 400))
    events: list[dict] = []
    awaiting: list[tuple[int, int]] = []
    total = sum(size for size, _ in live.values())
    peak, peak_live = total, dict(live)
    for _ in range(steps):
        if awaiting and rng.random() < 0.4:
            addr, size = awaiting.pop(rng.randrange(len(awaiting)))
            events.append({"action": "free_completed", "addr": addr, "size": size, "frames": []})
            free_addrs.append(addr)
        elif live and (rng.random() < 0.45 or not free_addrs):
            addr = rng.choice(list(live))
            size, _ = live.pop(addr)
            total -= size
            events.append({"action": "free_requested", "addr": addr, "size": size, "frames": []})
            awaiting.append((addr, size))
        else:
            addr = free_addrs.pop(rng.randrange(len(free_addrs)))
            k = rng.randrange(len(OWNERS))
            size = rng.randrange(1, 1 << 20)
            live[addr] = (size, f"hf_distca/model_{k}.py:{k} forward")
            total += size
            events.append({"action": "alloc", "addr": addr, "size": size, "frames": OWNERS[k]})
            if total > peak:
                peak, peak_live = total, dict(live)
    blocks = [
        {"address": a, "size": s + 511, "requested_size": s, "state": "active_allocated", "frames": []}
        for a, (s, _) in live.items()
    ]
    blocks += [{"address": a, "size": s, "requested_size": s, "state": "active_awaiting_free", "frames": []}
               for a, s in awaiting]  # fmt: skip
    by_group: dict[str, int] = defaultdict(int)
    for size, group in peak_live.values():
        by_group[group] += size
    snapshot = {"device_traces": [events], "segments": [{"device": 0, "blocks": blocks}]}
    return snapshot, peak, dict(by_group)


@pytest.mark.parametrize("seed", range(8))
def test_the_peak_and_its_breakdown_match_a_simulated_allocator(seed):
    snapshot, peak, by_group = _simulated(seed, 3000)
    report = peak_breakdown(snapshot, top=len(OWNERS))
    assert report["peak_gib"] * GIB == pytest.approx(peak, abs=1e-3)
    got = {g["group"]: g["gib"] * GIB for g in report["groups"] if g["gib"]}
    assert got == {group: pytest.approx(size, abs=1e-3) for group, size in by_group.items()}


def test_the_breakdown_sums_to_the_peak_with_the_rest_summed():
    snapshot, peak, _ = _simulated(99, 3000)
    report = peak_breakdown(snapshot, top=3)
    assert report["groups"][-1]["group"].endswith("more groups")
    assert len(report["groups"]) == 1 + 3 + 1
    assert sum(g["gib"] for g in report["groups"]) == pytest.approx(report["peak_gib"], rel=1e-12)
    assert report["peak_gib"] * GIB == pytest.approx(peak, abs=1e-3)


def test_a_long_trace_is_replayed_in_linear_time():
    # 200,000 events: 10,000 blocks of 1 MiB from before the recording freed first (20,000 events), then
    # 60,000 allocs of 1 MiB (a new peak at each), then their 120,000 frees; 1 GiB stays live throughout
    mib, n_before, n = 2**20, 10_000, 60_000
    events = []
    for addr in range(n_before):
        events.append({"action": "free_requested", "addr": addr, "size": mib, "frames": []})
        events.append({"action": "free_completed", "addr": addr, "size": mib, "frames": []})
    for k in range(n):
        events.append({"action": "alloc", "addr": 10**6 + k, "size": mib, "frames": OWNERS[k % 2]})
    for k in range(n):
        events.append({"action": "free_requested", "addr": 10**6 + k, "size": mib, "frames": []})
        events.append({"action": "free_completed", "addr": 10**6 + k, "size": mib, "frames": []})
    assert len(events) == 200_000
    snapshot = {"device_traces": [events], "segments": [{"device": 0, "blocks": [
        {"size": GIB, "state": "active_allocated"}]}]}  # fmt: skip
    began = time.perf_counter()
    report = peak_breakdown(snapshot)
    assert time.perf_counter() - began < 5.0
    assert report["start_gib"] * GIB == GIB + n_before * mib
    assert report["peak_gib"] * GIB == GIB + n * mib
    assert report["peak_event"] == 2 * n_before + n - 1
    groups = {g["group"]: g for g in report["groups"]}
    assert groups["before the recording"]["gib"] == pytest.approx(1)
    for k in range(2):
        assert groups[f"hf_distca/model_{k}.py:{k} forward"]["blocks"] == n // 2
    assert sum(g["gib"] for g in report["groups"]) == pytest.approx(report["peak_gib"])


def test_the_recipes_memory_snapshot_is_refused_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without CUDA")
    from test_recipe import load_recipe

    sample = tmp_path / "lengths.json"
    sample.write_text("[40, 90]")
    args = ["--doc-lengths", str(sample), "--num-documents", "8", "--max-steps", "1", "--tokens-per-rank", "256",
            "--no-save", "--output-dir", str(tmp_path / "out"), "--memory-snapshot"]  # fmt: skip
    with pytest.raises(ValueError, match="--memory-snapshot records the CUDA allocator: it needs a CUDA GPU"):
        load_recipe().main(args)
