"""Pre-flight checks: refuse, before training starts, what DistCA cannot do right; and the attention-server
group of a Trainer run (the data-parallel ranks of Accelerate's device mesh)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from hf_distca.config import DistCAConfig
from hf_distca.features import check_model_config
from hf_distca.kernels import resolve_backend


def check_launch(args) -> int:
    """The data-parallel world size, after checking the launcher and the Trainer agree on it.

    ``args``: TrainingArguments (uses ``world_size`` and ``process_index``)."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    seen = int(getattr(args, "world_size", 1) or 1)
    if launched > 1 and seen != launched:
        raise RuntimeError(
            f"the launcher started {launched} processes but the Trainer sees a world of {seen}. On a machine "
            "without GPUs pass TrainingArguments(use_cpu=True) so Accelerate starts its gloo process group."
        )
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() != seen:
        raise RuntimeError(
            f"torch.distributed has {dist.get_world_size()} ranks but the Trainer sees {seen}; DistCA uses "
            "every data-parallel rank as an attention server, so they must match"
        )
    return seen


def check_model_supported(model, *, disaggregate: bool = True) -> None:
    """Raise before training for a model DistCA cannot serve exactly (see :mod:`hf_distca.features`).

    disaggregate: the model must then use ``attn_implementation="distca"``."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise ValueError("DistCA needs a transformers PreTrainedModel (a model with a .config)")
    check_model_config(cfg, model_name=type(model).__name__)
    impl = getattr(cfg, "_attn_implementation", None)
    if disaggregate and impl != "distca":
        raise ValueError(
            f"the model uses attn_implementation={impl!r}; load it with attn_implementation='distca' "
            "(or model.set_attn_implementation('distca')), or pass DistCACallback(..., disaggregate=False) for "
            "a baseline run"
        )


def check_config_applies(
    config: DistCAConfig, *, attn_implementation: str | None, disaggregate: bool
) -> None:
    """Refuse DistCAConfig fields a run would silently not honour (:meth:`DistCAConfig.inert_fields`):
    without disaggregation the engine's (planning, dispatch, schedules) and, under another attention
    implementation than ``distca``, the kernel backend too. Every rank raises alike (same config)."""
    distca = attn_implementation == "distca"
    inert = config.inert_fields(distca_attention=distca, disaggregate=disaggregate)
    if not inert:
        return
    settings = ", ".join(f"{name}={getattr(config, name)!r} (--{name.replace('_', '-')})" for name in inert)
    if distca:
        where = "the distca attention function without disaggregation (--attn local, DistCACallback(disaggregate=False))"
    else:
        where = f"attn_implementation={attn_implementation!r} (no distca kernels, no disaggregation)"
    raise ValueError(
        f"DistCAConfig {settings}: no effect under {where}. Leave them at their defaults, or disaggregate core "
        "attention (attn_implementation='distca' with --attn distca / DistCACallback(disaggregate=True))"
        + ("" if distca else "; for the distca kernels without dispatch use --attn local")
    )


def check_backend_runs(config: DistCAConfig, device: torch.device, dtype: torch.dtype) -> str:
    """The kernel backend ``config.backend`` resolves to on ``device`` for ``dtype`` inputs; raises before
    training, naming the backend, when an explicit choice cannot run there."""
    return resolve_backend(config.backend, device, dtype)


def check_parallelism(parallelism_config: Any, *, model_tp_size: int | None = None) -> None:
    """Refuse mesh dimensions of Accelerate's ``ParallelismConfig`` that DistCA cannot serve exactly.

    DistCA keeps data-parallel semantics: every data-parallel rank (``dp_replicate x dp_shard``) holds
    whole tokens of its own and serves core attention for the others. ``parallelism_config``: the
    Accelerator's (None: plain data parallelism); ``model_tp_size``: the model's own tensor-parallel size
    (``from_pretrained(tp_plan=...)``), if any.
    """
    sizes = {name: int(getattr(parallelism_config, f"{name}_size", 1) or 1) for name in ("cp", "sp", "tp")}
    if sizes["cp"] > 1 or sizes["sp"] > 1:
        name = "cp_size" if sizes["cp"] > 1 else "sp_size"
        raise ValueError(
            f"ParallelismConfig({name}={max(sizes['cp'], sizes['sp'])}) splits every row over ranks that each run "
            "their own attention (torch context parallelism replaces the packed documents' mask with whole-row "
            "causal attention; DeepSpeed Ulysses re-shards heads), while DistCACallback already cuts long "
            "documents over the data-parallel ranks and balances their core attention. Drop cp_size/sp_size and "
            "give those ranks to data parallelism (dp_shard_size for FSDP2, dp_replicate_size for DDP); to run "
            "Ulysses or torch CP as a baseline, use recipes/sequence_parallel_long_docs.py without DistCACallback"
        )
    tp = max(sizes["tp"], int(model_tp_size or 1))
    if tp > 1:
        raise ValueError(
            f"tensor parallelism (tp_size={tp}) is not supported with DistCACallback: every tensor-parallel slice "
            "would need its own heads balanced over its data-parallel group. Use data parallelism for those ranks "
            "(ParallelismConfig(dp_shard_size=...) with FSDP2 shards the weights instead), or train without "
            "DistCACallback"
        )


def attention_server_group(device_mesh: Any, parallelism_config: Any) -> tuple[Any, int, int]:
    """``(group, rank, size)`` of the attention servers: the data-parallel ranks of Accelerate's mesh.

    ``device_mesh``: the Accelerator's ``torch_device_mesh`` (None without a ``ParallelismConfig``, or
    when its mesh is trivial): then the world, as ``torch.distributed`` knows it (``group`` None and size
    1 without a process group). Call :func:`check_parallelism` first: only data-parallel dimensions are
    served, so the group's rank order is the data loader's."""
    dp_dims = tuple(getattr(parallelism_config, "dp_dim_names", ()) or ())
    if device_mesh is not None and dp_dims:
        if device_mesh.ndim == 1:  # one data-parallel dimension and nothing else
            return device_mesh.get_group(), device_mesh.get_local_rank(), device_mesh.size()
        with warnings.catch_warnings():  # torch announces that slicing a flattened dimension will change
            warnings.simplefilter("ignore", UserWarning)
            mesh = device_mesh["dp"]  # Accelerate's flattened dp_replicate x dp_shard dimension
        return mesh.get_group(), mesh.get_local_rank(), mesh.size()
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    return None, 0, 1
