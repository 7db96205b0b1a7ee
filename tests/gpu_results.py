"""What the GPU tests found, for a results file: one JSON line per finding appended to the file that the
environment variable ``HF_DISTCA_GPU_RESULTS`` names (nothing is written when it is unset), with the
versions and the device it was found on."""

from __future__ import annotations

import json
import os
import time

import torch

RESULTS_ENV = "HF_DISTCA_GPU_RESULTS"


def nccl_version() -> str | None:
    """NCCL's version as ``major.minor.patch`` (None without NCCL)."""
    try:
        return ".".join(str(part) for part in torch.cuda.nccl.version())
    except Exception:  # a build without NCCL, or without CUDA
        return None


def record(test: str, **findings) -> None:
    """Append ``findings`` of ``test`` to the results file, if one is named."""
    path = os.environ.get(RESULTS_ENV)
    if not path:
        return
    line = {
        "test": test,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl_version(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "sanitizer": "TORCH_CUDA_SANITIZER" in os.environ,
        **findings,
    }
    with open(path, "a") as f:
        f.write(json.dumps(line, default=str) + "\n")
