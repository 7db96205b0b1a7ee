"""Run several recipe ``main(argv)`` calls one after another in one launch, sharing the start-up cost.

    torchrun --nproc-per-node 2 tests/run_recipes.py RUNS.json

RUNS.json: a list of ``[recipe file name in recipes/, [argv...]]``. Used by tests that compare recipes
on the same data (each run writes its own ``--output-dir``).
"""

from __future__ import annotations

import importlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    with open(sys.argv[1]) as f:
        runs = json.load(f)
    from finetune_long_docs import end_process_group

    for recipe, argv in runs:
        importlib.import_module(os.path.splitext(recipe)[0]).main(argv)
    end_process_group()
