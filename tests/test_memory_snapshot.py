"""hf_distca.memory_snapshot: the peak of a recorded window replayed from the allocator's events, on a
snapshot made by hand (the format of ``torch.cuda.memory._snapshot()``); the recipe's flag refused on the
CPU."""

from __future__ import annotations

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
    report = peak_breakdown(_snapshot([("free_requested", 7, 3, [])], [5]), top=1)
    assert report["peak_gib"] == pytest.approx(5)  # the replay never passes the 5 live at the end


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
