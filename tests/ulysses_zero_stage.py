"""Run recipes/sequence_parallel_long_docs.py under another ZeRO stage (tests only: the recipe runs ZeRO-3).

torchrun --nproc-per-node 2 tests/ulysses_zero_stage.py STAGE [recipe flags...]
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if __name__ == "__main__":
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    import sequence_parallel_long_docs as recipe

    recipe.ZERO3["zero_optimization"]["stage"] = int(sys.argv[1])
    recipe.main(sys.argv[2:])
    recipe.base.end_process_group()
