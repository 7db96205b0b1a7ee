"""The cost probe: which measured table ``DistCAConfig(cost_table="auto")`` plans with, agreed by every
rank of the group, resolved once per (group, kernel backend, dtype, head shape) at an explicit point
before the first engine call (:func:`probe_cost_table`; :func:`hf_distca.engine.probes.probe`, which
:func:`hf_distca.enable_distca` calls), kept in the engine state and read by the engine
(:func:`auto_cost_table`), which never runs a collective for it.

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

Every rank calls the probe at the same point, so its collectives line up. The measured table never
leaves the process.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hf_distca.comm import all_gather_rows, collective_device, group_rank_world
from hf_distca.config import COST_TABLE_AUTO, DistCAConfig
from hf_distca.cost_tables import find_shipped_table, load_shipped_table, timing
from hf_distca.engine.consistency import digest64
from hf_distca.engine.state import EngineState, engine_state, group_key
from hf_distca.kernels import resolve_backend
from hf_distca.planning.cost import MeasuredCost

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TableCase:
    """What one kernel-cost table is for: attention inputs of ``dtype`` with ``q_heads`` query and
    ``kv_heads`` key/value heads of ``head_dim`` (with the GPU model and kernel backend, what a shipped
    table is looked up by)."""

    dtype: torch.dtype
    q_heads: int
    kv_heads: int
    head_dim: int


def describe_device(device: torch.device, dtype: torch.dtype, config: DistCAConfig) -> tuple[str, str] | None:
    """(GPU model name, kernel backend ``config.backend`` resolves to) for a CUDA device; None elsewhere."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_name(device), resolve_backend(config.backend, device, dtype)


def probe_cost_table(
    config: DistCAConfig, group: Any, device: torch.device, case: TableCase, state: EngineState | None = None
) -> MeasuredCost | None:
    """Resolve the table ``cost_table="auto"`` plans with for attention inputs ``case`` on ``device`` (see
    the module docstring) into ``state`` (None: the process's), unless resolved
    before; returns it (None: causal pairs, and for any other ``cost_table``). Collective on ``group``
    (several ranks, CUDA): call it on every rank together."""
    state = state if state is not None else engine_state()
    if config.cost_table != COST_TABLE_AUTO:
        return None
    key = _key(config, group, device, case)
    if key not in state.cost_tables:
        described = describe_device(device, case.dtype, config)
        if described is None:
            state.cost_tables[key] = None
        else:
            device_name, backend = described
            state.cost_tables[key] = agree_on_table(
                group,
                device,
                case,
                backend,
                device_name=device_name,
                measurable=backend != "reference",
                state=state,
            )
    return state.cost_tables[key]


def auto_cost_table(
    config: DistCAConfig, group: Any, q: torch.Tensor, k: torch.Tensor, state: EngineState | None = None
) -> MeasuredCost | None:
    """The table :func:`probe_cost_table` resolved for these tensors; None for any other ``cost_table``
    and on the CPU. Never collective: on one process it resolves here (a shipped table or none); on several
    with CUDA tensors it raises when the probe has not run for their dtype and head shape."""
    if config.cost_table != COST_TABLE_AUTO:
        return None
    state = state if state is not None else engine_state()
    case = TableCase(q.dtype, q_heads=q.shape[1], kv_heads=k.shape[1], head_dim=q.shape[2])
    key = _key(config, group, q.device, case)
    if key not in state.cost_tables:
        described = describe_device(q.device, q.dtype, config)
        if described is None:
            return None  # not CUDA: causal pairs, nothing to probe
        if group_rank_world(group)[1] > 1:
            raise RuntimeError(
                f"DistCAConfig(cost_table='auto'): no kernel-cost table was resolved for {q.dtype} attention with "
                f"{case.q_heads}/{case.kv_heads} heads x {case.head_dim} on this process group; the probe is collective and runs "
                "before the first engine call, on every rank: hf_distca.enable_distca(model, group=..., dtype=...) "
                "with the dtype the attention layers compute in, or hf_distca.engine.probe(config, group=..., "
                "device=..., dtypes=..., q_heads=..., kv_heads=..., head_dim=...); or set cost_table=None or a path"
            )
        # one process: its shipped table or none (nothing is balanced, so nothing is measured)
        state.cost_tables[key] = shipped_table(described[0], case, described[1])
    return state.cost_tables[key]


def shipped_table(device_name: str, case: TableCase, backend: str) -> MeasuredCost | None:
    """The table shipped for this GPU model, inputs and kernel backend; None without one."""
    shipped = _find_shipped(device_name, case, backend)
    return None if shipped is None else load_shipped_table(shipped)


def _find_shipped(device_name: str, case: TableCase, backend: str) -> str | None:
    return find_shipped_table(device_name, case.dtype, case.q_heads, case.kv_heads, case.head_dim, backend)


def _key(config: DistCAConfig, group: Any, device: torch.device, case: TableCase) -> tuple:
    return (group_key(group), device.type, config.backend, case)


def agree_on_table(
    group: Any,
    device: torch.device,
    case: TableCase,
    backend: str,
    *,
    device_name: str,
    measurable: bool,
    lens: list[int] | None = None,
    fuse_tokens: int = 65536,
    warmup: int | None = None,
    repeats: int | None = None,
    state: EngineState | None = None,
) -> MeasuredCost | None:
    """The table every rank of ``group`` plans with (identical on all ranks): the shipped one of
    ``device_name`` when every rank found the same; else, when every rank is ``measurable``, the mean of
    the ranks' tables measured with ``backend`` over ``lens`` (default the start-up grid) with
    ``warmup`` / ``repeats`` calls per cell (default the start-up ones); else None (causal pairs).
    Collective on ``group`` when it has several ranks; on one process the shipped table or None. The
    seconds a measurement took go to ``state.measurement_seconds`` (None: the process's state)."""
    _, world = group_rank_world(group)
    if world == 1:
        return shipped_table(device_name, case, backend)
    shipped = _find_shipped(device_name, case, backend)
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
        heads=case.q_heads,
        kv_heads=case.kv_heads,
        head_dim=case.head_dim,
        dtype=case.dtype,
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
    seconds = time.perf_counter() - start
    (state if state is not None else engine_state()).measurement_seconds = seconds
    if dist.get_rank(group) == 0:
        _log_measurement(device, case, backend, len(lens), world, seconds)
    return MeasuredCost(lens, lens, mean)


def _log_measurement(device, case: TableCase, backend, n, world, seconds) -> None:
    logger.warning(
        "cost_table='auto': no shipped kernel table for %s %s, %d/%d heads x %d, %s: measured a %dx%d "
        "start-up table in %.2f s (the mean of %d ranks'; python -m hf_distca.calibrate writes a full "
        "one for DistCAConfig(cost_table=PATH))",
        torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        str(case.dtype).removeprefix("torch."),
        case.q_heads,
        case.kv_heads,
        case.head_dim,
        backend,
        n,
        n,
        seconds,
        world,
    )
