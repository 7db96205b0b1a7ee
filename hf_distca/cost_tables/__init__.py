"""Measured CA-task cost tables shipped with the package, and the rule that picks one for a run.

Each ``*.json`` here is a table written by ``python -m hf_distca.calibrate`` (format
``hf_distca.cost_table/1``) whose ``measured`` object says where and how it was measured: the GPU
(``device``, as ``torch.cuda.get_device_name`` reports it), ``dtype``, ``heads``, ``kv_heads``,
``head_dim``, the kernel ``backend`` that ran, what was ``timed``, and the software versions (``torch``,
``cuda``, ``cudnn``, ``cudnn_frontend``, ``python``). :func:`find_shipped_table` is the resolution rule
``DistCAConfig(cost_table="auto")`` uses on CUDA tensors (:mod:`hf_distca.engine.cost_probe`): pure
Python, no torch.

Shipped (1 x NVIDIA H200, torch 2.11, forward+backward; how they were measured:
benchmarks/results/cost_tables_h200.md):

- ``h200_bf16_32x8x128_cudnn.json``: bfloat16, 32 query / 8 KV heads x 128 (Llama-3-8B), cudnn;
- ``h200_bf16_32x8x128_torch_varlen.json``: the same shape, torch_varlen.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

from hf_distca.planning.cost import TIMED, MeasuredCost

MATCH_FIELDS = ("device", "dtype", "heads", "kv_heads", "head_dim", "backend")
"""The ``measured`` fields a shipped table must match (besides being timed forward+backward)."""


def normalize_device_name(name: str) -> str:
    """``name`` case-folded with runs of white space as one space (how device names are compared)."""
    return " ".join(str(name).split()).casefold()


def normalize_dtype(dtype: Any) -> str:
    """A dtype's name as tables write it: ``torch.bfloat16`` and ``"bfloat16"`` both give ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def shipped_table_names() -> list[str]:
    """File names of the shipped tables, sorted."""
    return sorted(entry.name for entry in resources.files(__name__).iterdir() if entry.name.endswith(".json"))


@functools.cache
def shipped_table_data(name: str) -> dict[str, Any]:
    """The parsed JSON of the shipped table ``name`` (read through importlib.resources)."""
    return json.loads(resources.files(__name__).joinpath(name).read_text())


def table_matches(
    measured: dict[str, Any],
    *,
    device_name: str,
    dtype: Any,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    backend: str,
) -> bool:
    """Whether a table's ``measured`` description fits this run: the same GPU model (names compared
    case- and space-insensitively), dtype, head shape and kernel backend, timed forward+backward."""
    want = {
        "device": normalize_device_name(device_name),
        "dtype": normalize_dtype(dtype),
        "heads": int(q_heads),
        "kv_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "backend": backend,
    }
    have = {k: measured.get(k) for k in MATCH_FIELDS}
    if isinstance(have["device"], str):
        have["device"] = normalize_device_name(have["device"])
    return have == want and measured.get("timed", TIMED[0]) == TIMED[0]


def find_shipped_table(
    device_name: str, dtype: Any, q_heads: int, kv_heads: int, head_dim: int, backend: str
) -> str | None:
    """The name of the shipped table measured on ``device_name`` (e.g. ``"NVIDIA H200"``) for this
    dtype, head shape and concrete kernel ``backend`` (as :func:`hf_distca.kernels.resolve_backend`
    gives it: a cudnn table for cudnn, a torch_varlen one for torch_varlen); None when none fits."""
    for name in shipped_table_names():
        measured = shipped_table_data(name).get("measured") or {}
        if table_matches(
            measured,
            device_name=device_name,
            dtype=dtype,
            q_heads=q_heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            backend=backend,
        ):
            return name
    return None


@functools.cache
def load_shipped_table(name: str) -> MeasuredCost:
    """The shipped table ``name`` as the planner's cost model."""
    return MeasuredCost.from_dict(shipped_table_data(name), f"hf_distca.cost_tables/{name}")
