"""Run several recipe ``main(argv)`` calls one after another in one launch, sharing the start-up cost.

    torchrun --nproc-per-node 2 tests/run_recipes.py RUNS.json

RUNS.json: a list of ``[recipe file name in recipes/, [argv...]]``. Used by tests that compare recipes
on the same data (each run writes its own ``--output-dir``), through :func:`launch`.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def exact_run_args(max_steps: int, num_documents: int) -> list[str]:
    """The recipe's arguments shared by the runs that must equal a one-process run: plain SGD (weights then
    compare parameter by parameter), two accumulated micro-batches per step, generated documents of up to
    1,500 words (longer than a rank's budget, so some are cut over the ranks), 64-token shards."""
    return [
        "--max-steps", str(max_steps), "--grad-accum", "2", "--optim", "sgd", "--learning-rate", "0.5",
        "--num-documents", str(num_documents), "--mean-doc-words", "300", "--max-doc-words", "1500",
        "--shard-tokens", "64", "--seed", "3",
    ]  # fmt: skip


def launch(world: int, runs: list, tmp_path) -> None:
    """One torchrun launch of ``world`` processes running ``runs`` ([recipe, argv] pairs) in turn; fails
    the calling test with the processes' output if the launch fails."""
    spec = tmp_path / f"runs{world}.json"
    spec.write_text(json.dumps(runs))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
        os.path.join(ROOT, "tests", "run_recipes.py"), str(spec),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{world} process(es):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    with open(sys.argv[1]) as f:
        runs = json.load(f)
    from finetune_long_docs import end_process_group

    for recipe, argv in runs:
        importlib.import_module(os.path.splitext(recipe)[0]).main(argv)
    end_process_group()
