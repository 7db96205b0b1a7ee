"""The planner's price of a model's decoder-layer work, derived from its weights.

Layer-level ping-pong (``DistCAConfig.layer_ping_pong``) hides a nano-batch's exchanges behind the other
nano-batch's layer work; the planner prices what it hides with ``DistCAConfig.layer_seconds_per_token``.
:func:`with_layer_pricing` derives that figure from the model's first decoder layer, its matmul weights at
``DistCAConfig.layer_tflops`` (:func:`hf_distca.planning.links.layer_seconds_per_token`), when the config
asks for layer ping-pong and gives none.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch

from hf_distca.config import DistCAConfig
from hf_distca.planning.links import layer_seconds_per_token

__all__ = ["MOE_CONFIG_FIELDS", "decoder_layer_weights", "with_layer_pricing"]


MOE_CONFIG_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
"""Model config fields that mark mixture-of-experts layers (a few experts of many run per token)."""


def decoder_layer_weights(model: torch.nn.Module) -> int | None:
    """Weights of the matmuls (parameters of 2 or more dimensions: projections, MLP) of ``model``'s first
    decoder layer, the first module list as long as its (text) config's ``num_hidden_layers``. None when
    there is none, when it holds no such weight, or for mixture-of-experts models (every expert's weights
    would count; a few run per token). Counts the full shapes of parameters sharded by FSDP2 (DTensor) or
    partitioned by ZeRO-3 (``ds_shape``)."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    layers = getattr(config, "num_hidden_layers", None)
    if not layers or any(getattr(config, name, None) for name in MOE_CONFIG_FIELDS):
        return None
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == layers:
            shapes = [getattr(p, "ds_shape", p.shape) for p in module[0].parameters()]
            return sum(math.prod(shape) for shape in shapes if len(shape) >= 2) or None
    return None


def with_layer_pricing(config: DistCAConfig, model: torch.nn.Module) -> DistCAConfig:
    """``config`` with ``layer_seconds_per_token`` derived from ``model``'s decoder layer at
    ``config.layer_tflops`` when ``config.layer_ping_pong`` is on and it gives none; ``config`` itself
    otherwise, and (with a warning: every transfer is then priced exposed) when it cannot be derived."""
    if not config.layer_ping_pong or config.layer_seconds_per_token is not None:
        return config
    weights = decoder_layer_weights(model)
    if weights is None:
        warnings.warn(
            "enable_distca: layer_ping_pong is on but the seconds per token of a decoder layer could not "
            "be derived from this model (no decoder layer list found, or mixture-of-experts layers): the "
            "planner prices every transfer as exposed; give DistCAConfig(layer_seconds_per_token=...) "
            "(~4e-6 for a Llama-3-8B-shaped layer on an H200)",
            stacklevel=3,
        )
        return config
    seconds = layer_seconds_per_token(weights, config.layer_tflops)
    return dataclasses.replace(config, layer_seconds_per_token=seconds)
