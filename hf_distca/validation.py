"""Pre-flight checks: refuse, before training starts, what DistCA cannot do right."""

from __future__ import annotations

import os

import torch.distributed as dist

from hf_distca.features import check_model_config


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


def check_model_supported(model, *, max_document_tokens: int, disaggregate: bool = True) -> None:
    """Raise before training for a model DistCA cannot serve exactly (see :mod:`hf_distca.features`).

    max_document_tokens: the longest document a micro-batch can hold (tokens_per_rank x world).
    disaggregate: the model must then use ``attn_implementation="distca"``."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise ValueError("DistCA needs a transformers PreTrainedModel (a model with a .config)")
    check_model_config(cfg, model_name=type(model).__name__, max_document_tokens=max_document_tokens)
    impl = getattr(cfg, "_attn_implementation", None)
    if disaggregate and impl != "distca":
        raise ValueError(
            f"the model uses attn_implementation={impl!r}; load it with attn_implementation='distca' "
            "(or model.set_attn_implementation('distca')), or pass DistCACallback(..., disaggregate=False) for "
            "a baseline run"
        )
