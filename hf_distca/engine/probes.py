"""The engine's start-up probes at one explicit point, before the first engine call: the link probe
(:mod:`.link_probe`, ``DistCAConfig(measure_link=True)``) and the kernel-cost probe (:mod:`.cost_probe`,
``cost_table="auto"`` on CUDA). Both may run collectives, so every rank of the group calls :func:`probe`
at the same point (:func:`hf_distca.enable_distca` does); the results go into the engine state, which the
engine reads (a layer's call never probes), and the time they took into :mod:`hf_distca.metrics`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from hf_distca import metrics
from hf_distca.comm import group_rank_world
from hf_distca.config import DistCAConfig
from hf_distca.engine.cost_probe import TableCase, probe_cost_table
from hf_distca.engine.link_probe import probe_link
from hf_distca.engine.state import EngineState, engine_state

__all__ = ["probe"]


def probe(
    config: DistCAConfig,
    *,
    group: Any = None,
    device: torch.device,
    dtypes: Iterable[torch.dtype] = (),
    q_heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    state: EngineState | None = None,
) -> None:
    """Run the probes ``config`` asks for on ``group`` (None: the world) into ``state`` (None: the
    process's): the link once per group; the kernel-cost table once per attention input dtype of
    ``dtypes`` with this head shape on ``device`` (skipped without a head shape). Collective on ``group``
    when it has several ranks: call it on every rank together, before the first engine call. What was
    probed before (in ``state``) is not probed again; a round that probed something is recorded in
    :mod:`hf_distca.metrics` (``probes``, ``probe_seconds``)."""
    if group_rank_world(group)[1] == 1:
        return  # one process: nothing to measure (a shipped cost table is found at the first call)
    state = state if state is not None else engine_state()
    known = len(state.link_gib_per_s) + len(state.cost_tables)
    start = time.perf_counter()
    probe_link(config, group, device, state)
    if q_heads and kv_heads and head_dim:
        for dtype in dict.fromkeys(dtypes):
            probe_cost_table(config, group, device, TableCase(dtype, q_heads, kv_heads, head_dim), state)
    if len(state.link_gib_per_s) + len(state.cost_tables) > known:  # probed now, not before
        metrics.record_probe(time.perf_counter() - start)
