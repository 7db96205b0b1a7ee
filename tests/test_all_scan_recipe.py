"""recipes/hybrid_linear_loop.py: MiniMax (lightning + softmax attention) and Qwen3-Next (gated DeltaNet +
softmax attention) trained on 2 CPU processes x 2 accumulated micro-batches, with documents cut across them, equal 1 process with the same global batch in one micro-batch, step by step (fp32, SGD): a
loop that divides the gradient by the accumulation steps a second time fails it from step 2."""

from __future__ import annotations

import json

import pytest
from run_recipes import launch
from tolerances import TOL


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["minimax", "qwen3-next"])
def test_all_scan_hybrid_recipe_exact_across_world_sizes(tmp_path, arch):
    losses, outputs = {}, {}
    for world, grad_accum, tokens_per_rank in ((1, 1, 2048), (2, 2, 512)):
        out = tmp_path / f"losses{world}.json"
        argv = [
            "--arch", arch, "--tokens-per-rank", str(tokens_per_rank), "--max-steps", "3", "--grad-accum",
            str(grad_accum), "--backend", "reference", "--losses-file", str(out),
        ]  # fmt: skip
        outputs[world] = launch(world, [["hybrid_linear_loop.py", argv]], tmp_path)[0]
        losses[world] = json.loads(out.read_text())
    assert len(losses[1]) == 3
    for got, want in zip(losses[2], losses[1], strict=True):
        assert abs(got - want) <= TOL["train_loss"][0] * abs(want), (losses[2], losses[1])
    assert losses[1][-1] < losses[1][0]  # it trains
    assert "3 linear-attention layers on the all_scan scan, 2 rank(s)" in outputs[2]
    cut = [line for line in outputs[2].splitlines() if line.startswith("documents cut across ranks:")]
    assert cut and int(cut[0].split(":")[1]) > 0, outputs[2]  # the scan really carried states across ranks
