"""The cost probe: which measured table ``DistCAConfig(cost_table="auto")`` plans with, agreed by every
rank of the group, resolved once per (group, kernel backend, dtype, head shape) at the first engine call.

- CPU tensors: no table (causal pairs); nothing runs.
- CUDA: each rank looks for a shipped table of its GPU model, dtype, head shape and resolved kernel
  backend (:func:`hf_distca.cost_tables.find_shipped_table`). On one process that table or none (nothing
  is balanced on one process, so nothing is measured). On several, one all-gather of
  [shipped table digest, can measure] decides for every rank alike: the shipped table when every rank
  found the same one; else, when every rank can measure, every rank times the start-up grid
  (:data:`hf_distca.cost_tables.timing.STARTUP_LENS`, 3.3 s with torch_varlen and 6.6 s with cudnn on an H200 at 32/8 x 128: the README)
  on its own GPU and an all-reduce averages the ranks' tables, so that every rank plans with the same
  table (the mean: the servers are alike, and averaging damps one rank's timing noise); else none. A kernel
  that resolves to ``reference`` (float32, or no CUDA kernel installed) is never measured (it is the
  test oracle, and materializes scores): causal pairs.

Every rank reaches the resolution at the same point (prepare, right before planning, as the link probe),
so its collectives line up; the result is cached per process. The measured table never leaves the process.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from hf_distca.comm import all_gather_rows, collective_device, group_rank_world
from hf_distca.config import COST_TABLE_AUTO, DistCAConfig
from hf_distca.cost_tables import find_shipped_table, load_shipped_table, timing
from hf_distca.engine.consistency import digest64
from hf_distca.kernels import resolve_backend
from hf_distca.planning.cost import MeasuredCost

logger = logging.getLogger(__name__)

_resolved: dict[tuple, MeasuredCost | None] = {}
last_measurement_seconds: float | None = None
"""Wall-clock seconds of this process's latest start-up measurement (the grid and the all-reduce); None
before any."""


def describe_device(q: torch.Tensor, config: DistCAConfig) -> tuple[str, str] | None:
    """(GPU model name, kernel backend ``config.backend`` resolves to) for CUDA tensors; None elsewhere."""
    if q.device.type != "cuda":
        return None
    return torch.cuda.get_device_name(q.device), resolve_backend(config.backend, q.device, q.dtype)


def auto_cost_table(
    config: DistCAConfig, group: Any, q: torch.Tensor, k: torch.Tensor
) -> MeasuredCost | None:
    """The table ``cost_table="auto"`` resolves to for these tensors (see the module docstring); None for
    any other ``cost_table`` and where causal pairs are priced. Collective on ``group`` (several ranks,
    CUDA) on the first call per key, cached after."""
    if config.cost_table != COST_TABLE_AUTO:
        return None
    q_heads, head_dim, kv_heads = q.shape[1], q.shape[2], k.shape[1]
    key = (_group_key(group), q.device.type, config.backend, q.dtype, q_heads, kv_heads, head_dim)
    if key not in _resolved:
        described = describe_device(q, config)
        if described is None:
            _resolved[key] = None
        else:
            device_name, backend = described
            _resolved[key] = agree_on_table(
                group,
                q.device,
                q.dtype,
                q_heads,
                kv_heads,
                head_dim,
                backend,
                device_name=device_name,
                measurable=backend != "reference",
            )
    return _resolved[key]


def agree_on_table(
    group: Any,
    device: torch.device,
    dtype: torch.dtype,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    backend: str,
    *,
    device_name: str,
    measurable: bool,
    lens: list[int] | None = None,
    fuse_tokens: int = 65536,
    warmup: int | None = None,
    repeats: int | None = None,
) -> MeasuredCost | None:
    """The table every rank of ``group`` plans with (identical on all ranks): the shipped one of
    ``device_name`` when every rank found the same; else, when every rank is ``measurable``, the mean of
    the ranks' tables measured with ``backend`` over ``lens`` (default the start-up grid) with
    ``warmup`` / ``repeats`` calls per cell (default the start-up ones); else None (causal pairs).
    Collective on ``group`` when it has several ranks; on one process the shipped table or None."""
    global last_measurement_seconds
    shipped = find_shipped_table(device_name, dtype, q_heads, kv_heads, head_dim, backend)
    _, world = group_rank_world(group)
    if world == 1:
        return None if shipped is None else load_shipped_table(shipped)
    digest = 0 if shipped is None else digest64(load_shipped_table(shipped).digest())
    mine = [int(shipped is not None), digest, int(measurable)]  # [found, its digest, can measure]
    everyone = all_gather_rows(mine, group, device)
    if all(row[0] == 1 and row[1] == digest for row in everyone):
        return load_shipped_table(shipped)
    if not all(row[2] for row in everyone):
        logger.info(
            "cost_table='auto': no shipped table fits every rank and not every rank can measure; "
            "planning with causal pairs"
        )
        return None
    # the mean of the ranks' measured tables
    lens = sorted(set(timing.STARTUP_LENS if lens is None else lens))
    start = time.perf_counter()
    seconds, _ = timing.time_table(
        lens,
        lens,
        heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        backend=backend,
        fuse_tokens=fuse_tokens,
        warmup=timing.STARTUP_WARMUP if warmup is None else warmup,
        repeats=timing.STARTUP_REPEATS if repeats is None else repeats,
        log=logger.debug,
    )
    table = torch.tensor(
        [[float("nan") if x is None else x for x in row] for row in seconds], dtype=torch.float64
    )  # (len(lens), len(lens)); NaN where q_len > kv_len, on every rank alike
    table = table.to(collective_device(group, device))
    dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group)
    mean = (table / world).cpu().tolist()
    last_measurement_seconds = time.perf_counter() - start
    if dist.get_rank(group) == 0:
        _log_measurement(device, dtype, q_heads, kv_heads, head_dim, backend, len(lens), world)
    return MeasuredCost(lens, lens, mean)


def _log_measurement(device, dtype, q_heads, kv_heads, head_dim, backend, n, world) -> None:
    logger.warning(
        "cost_table='auto': no shipped kernel table for %s %s, %d/%d heads x %d, %s: measured a %dx%d "
        "start-up table in %.2f s (the mean of %d ranks'; python -m hf_distca.calibrate writes a full "
        "one for DistCAConfig(cost_table=PATH))",
        torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        str(dtype).removeprefix("torch."),
        q_heads,
        kv_heads,
        head_dim,
        backend,
        n,
        n,
        last_measurement_seconds,
        world,
    )


def clear_cost_tables() -> None:
    """Forget resolved tables (the next engine call resolves again, collectively: call it on every rank)."""
    _resolved.clear()


def _group_key(group: Any) -> int:
    if group is None:
        return id(dist.group.WORLD) if dist.is_available() and dist.is_initialized() else 0
    return id(group)
