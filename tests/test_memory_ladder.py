"""benchmarks/memory_ladder.py on the CPU: the tiny model over 2 sizes and 2 technique sets, and a run that fails.

Each row must say ok, carry the step time of the step after the first and tokens/s, and the recipe's accounting
by owner must equal the sizes computed here from the model's shape (weights, gradients, one micro-batch's
checkpointed inputs on the device or, offloaded, in host memory, the kept attention outputs). ``+liger`` on the
CPU is refused by the recipe: that row must say error with the recipe's message, and end that set's climb.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_recipe import load_recipe

from benchmarks import memory_ladder

SIZES = (1024, 2048)
SETS = ("remat", "remat+offload+kept+tiled+norms")
VOCAB = 4096  # the recipe's --doc-lengths vocabulary (LENGTHS_VOCAB)
GIB = 2**30


def expected_owners(tokens: int, offloaded: bool) -> dict[str, float]:
    recipe = load_recipe()
    assert recipe.LENGTHS_VOCAB == VOCAB
    config = recipe.builtin_config("tiny-llama", vocab_size=VOCAB)
    with torch.device("meta"):
        params = sum(p.numel() for p in recipe.AutoModelForCausalLM.from_config(config).parameters())
    layers, hidden, heads = config.num_hidden_layers, config.hidden_size, config.num_attention_heads
    inputs = layers * tokens * hidden * 4  # float32 layer inputs
    kept = layers * tokens * heads * ((hidden // heads) * 4 + 4)  # output (T, H, D) and float32 lse (T, H)
    return {
        "weights_gib": params * 4 / GIB,
        "gradients_gib": params * 4 / GIB,
        "optimizer_state_gib": 0.0,  # SGD without momentum
        "checkpointed_inputs_gpu_gib": 0.0 if offloaded else inputs / GIB,
        "checkpointed_inputs_host_gib": inputs / GIB if offloaded else 0.0,
        "kept_attention_gpu_gib": kept / GIB,  # no CUDA device: "auto" keeps every output where it is
        "kept_attention_host_gib": 0.0,
        "kept_attention_dropped_gib": 0.0,
        "rest_gib": None,
    }


def test_ladder_rows_on_the_cpu(tmp_path):
    lengths = tmp_path / "lengths.json"
    lengths.write_text("[100, 300, 700, 1500]")
    out = tmp_path / "ladder"
    sizes = ",".join(map(str, SIZES))
    argv = ["--out", str(out), "--model", "tiny-llama", "--device", "cpu", "--doc-lengths", str(lengths),
            "--timeout", "150", *(a for s in SETS for a in ("--ladder", f"{s}={sizes}")),
            "--ladder", f"+liger={sizes}"]  # fmt: skip
    rows = memory_ladder.main(argv)
    assert [(r["technique"], r["tokens"]) for r in rows] == [
        *((s, t) for s in SETS for t in SIZES),
        ("+liger", SIZES[0]),  # its first run fails: the climb ends there
    ]
    for row in rows[:-1]:
        assert row["status"] == "ok", (row["technique"], row["tokens"], Path(row["log"]).read_text()[-2000:])
        assert row["step_time_s"] > 0
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["step_time_s"])
        assert row["peak_allocated_gib"] is None and row["host_pinned_gib"] is None  # no device figures
        offloaded = "offload" in row["technique"]
        want = expected_owners(row["tokens"], offloaded)
        assert row["by_owner"].keys() == want.keys()
        for key, value in want.items():
            expected = value if value is None else pytest.approx(value, rel=1e-9)
            assert row["by_owner"][key] == expected, (row["technique"], key)
        assert ("offload_inputs_host_layers" in row["split"]) == offloaded
    failed = rows[-1]
    assert failed["status"] == "error" and "--liger needs a CUDA GPU" in failed["message"], failed
    saved = json.loads((out / "ladder.json").read_text())
    assert saved["rows"] == rows and saved["command"].startswith("python -m benchmarks.memory_ladder --out ")
    table = (out / "ladder.md").read_text()
    assert saved["command"] in table and "n/a (CPU)" in table
    assert sum(line.startswith(("| 1024 ", "| 2048 ")) for line in table.splitlines()) == len(rows)
    assert "error: ValueError: --liger needs a CUDA GPU" in table


def test_classify_statuses():
    oom = "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.75 GiB\n"
    assert memory_ladder.classify(1, oom, False, 60) == {
        "status": "OOM",
        "message": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.75 GiB",
    }
    assert memory_ladder.classify(0, "", True, 60) == {"status": "ok"}
    assert memory_ladder.classify(0, "", False, 60)["status"] == "error"  # no summary.json: not ok
    assert memory_ladder.classify(None, "", False, 60) == {"status": "timeout (60 s)"}
    assert memory_ladder.classify(-9, "step 1", False, 60)["status"].startswith("killed")
    usage = (
        "usage: finetune_long_docs.py [-h]\nfinetune_long_docs.py: error: unrecognized arguments: --bogus\n"
    )
    assert memory_ladder.classify(2, usage, False, 60)["message"].endswith("unrecognized arguments: --bogus")
    with pytest.raises(ValueError, match="unknown technique"):
        memory_ladder.parse_ladder(["+bogus=1024"], "")
    assert memory_ladder.technique_set("+offload") == ["remat", "liger", "offload"]
