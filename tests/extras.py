"""Optional packages of the test suite: a test that needs one imports it through :func:`require`.

The ``test`` extra installs every package the CPU tests import, so a missing one fails the test (the
environment is incomplete, and CI must not turn green by skipping). Leaving an extra out on purpose is said
with ``HF_DISTCA_SKIP_EXTRAS`` (comma-separated extra names, e.g. ``deepspeed,trl``): then its tests skip,
naming the extra. CUDA-only packages (flash-linear-attention, cudnn-frontend) are for the GPU tests, which
skip without a GPU.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

SKIP_VARIABLE = "HF_DISTCA_SKIP_EXTRAS"


def skipped_extras() -> set[str]:
    """The extras this run leaves out on purpose (``HF_DISTCA_SKIP_EXTRAS``)."""
    return {name.strip() for name in os.environ.get(SKIP_VARIABLE, "").split(",") if name.strip()}


def require(module: str, extra: str) -> ModuleType:
    """Import ``module`` (from the package extra ``extra``); when it is missing, skip if that extra is left out
    on purpose, else fail saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        if extra in skipped_extras():
            pytest.skip(f"{module} not installed: the '{extra}' extra is left out ({SKIP_VARIABLE})")
        pytest.fail(
            f"{module} is not installed ({err}); the test extra installs it: pip install -e '.[test]' "
            f"(or set {SKIP_VARIABLE}={extra} to leave the '{extra}' extra out on purpose)",
            pytrace=False,
        )
