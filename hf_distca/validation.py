"""Pre-flight checks: refuse, before training starts, what DistCA cannot do right."""

from __future__ import annotations

import os

import torch.distributed as dist

from hf_distca.kernels import UnsupportedFeatureError


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
    """Raise UnsupportedFeatureError for attention the engine cannot serve exactly.

    max_document_tokens: the longest document a micro-batch can hold (tokens_per_rank x world)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise ValueError("DistCA needs a transformers PreTrainedModel (a model with a .config)")
    name = type(model).__name__
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedFeatureError(
            f"{name} is an encoder-decoder model: cross-attention is not supported; use a decoder-only model"
        )
    if getattr(cfg, "is_causal", True) is False:
        raise UnsupportedFeatureError(
            f"{name} is configured non-causal (is_causal=False); DistCA is causal only"
        )
    for key in ("attn_logit_softcapping", "attn_softcap"):
        if getattr(cfg, key, None):
            raise UnsupportedFeatureError(
                f"{name} uses attention logit softcapping ({key}={getattr(cfg, key)}); not supported by DistCA"
            )
    window = getattr(cfg, "sliding_window", None)
    uses_window = window is not None and getattr(cfg, "use_sliding_window", True) is not False
    if uses_window and window < max_document_tokens:
        raise UnsupportedFeatureError(
            f"{name} uses sliding-window attention (sliding_window={window}) and documents may reach "
            f"{max_document_tokens} tokens; set config.sliding_window=None (or use_sliding_window=False) or "
            "keep tokens_per_rank x world_size <= the window"
        )
    if getattr(cfg, "attention_dropout", 0.0):
        raise UnsupportedFeatureError(
            f"{name} has attention_dropout={cfg.attention_dropout}; DistCA kernels have no dropout: set it to 0.0"
        )
    impl = getattr(cfg, "_attn_implementation", None)
    if disaggregate and impl != "distca":
        raise ValueError(
            f"the model uses attn_implementation={impl!r}; load it with attn_implementation='distca' "
            "(or model.set_attn_implementation('distca')), or pass DistCACallback(..., disaggregate=False) for "
            "a baseline run"
        )
