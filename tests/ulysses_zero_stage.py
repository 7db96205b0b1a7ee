"""Run recipes/sequence_parallel_long_docs.py under another ZeRO stage (tests only: the recipe runs ZeRO-3).

torchrun --nproc-per-node 2 tests/ulysses_zero_stage.py STAGE [recipe flags...]

or ``main([STAGE, *flags])`` on each rank (tests/run_recipes.py's ``launch``).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
import sequence_parallel_long_docs as recipe  # noqa: E402


def main(argv: list[str]) -> dict:
    """``argv``: the ZeRO stage, then the recipe's flags."""
    recipe.ZERO3["zero_optimization"]["stage"] = int(argv[0])
    return recipe.main(argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
    recipe.base.end_process_group()
