"""What ``attn_implementation="distca"`` refuses: the one place that decides it.

The distca kernels compute causal softmax attention, document by document, optionally inside a sliding
window (each layer's ``sliding_window``: Mistral, Qwen2/Qwen3 with ``use_sliding_window``, Gemma 2/3's
local layers, gpt-oss), with attention logit softcapping (Gemma 2: ``attn_logit_softcapping``, passed as
``softcap``) and attention sinks (gpt-oss: its ``sinks`` parameter, passed as ``s_aux``), all exact. A model
feature that changes that math would be silently ignored, so it is refused with
:class:`UnsupportedFeatureError` instead: bidirectional or cross-attention, attention dropout in
training. Two entry points share the checks and their messages:

- :func:`check_model_config`: before training (the callback's pre-flight), from the model config;
- :func:`check_attention_call`: on every call of the attention function, from the module and the
  keyword arguments Transformers passes.

Refused elsewhere, where the fact lives: softcapping on a kernel backend that cannot compute it (cudnn,
torch_varlen: :mod:`hf_distca.kernels` names 'flash_attn' and 'reference', which can). Sinks need no
backend support (they are applied to any backend's output and log-sum-exp). Softcapping and sinks are
computed eagerly only: inside ``torch.compile`` they are refused here.

``output_attentions=True`` changes no math but asks for weights distca never builds: it warns (as
Transformers' ``sdpa`` does) and the model's ``attentions`` output holds none.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from hf_distca.kernels import UnsupportedFeatureError

__all__ = [
    "UnsupportedFeatureError",
    "check_attention_call",
    "check_model_config",
    "layer_windows",
]


def check_model_config(config: Any, *, model_name: str) -> None:
    """Pre-flight: refuse a model whose attention distca cannot compute exactly (sliding windows of any
    length, softcapping and sinks are computed exactly; which kernel backend computes softcapping is
    decided when the kernel runs)."""
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedFeatureError(
            f"{model_name} is an encoder-decoder model: cross-attention is not supported by "
            "attn_implementation='distca'; use a decoder-only model"
        )
    _check_causal(getattr(config, "is_causal", True), f"{model_name}'s config")
    _check_dropout(getattr(config, "attention_dropout", 0.0) or 0.0, model_name)


def check_attention_call(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, dropout: float, kwargs: dict
) -> None:
    """Per call of the attention function: shapes, and every feature the call asks for.

    query: (B, Hq, S_q, D); key: (B, Hkv, S_k, D) with S_q <= S_k (keys beyond the queries are past keys
    from a KV cache). ``sliding_window`` must be None or a positive int, ``softcap`` None or a positive
    number, the sinks (``s_aux``) None or one logit per query head.
    """
    if query.dim() != 4 or key.dim() != 4:
        raise ValueError(
            f"distca attention expects query/key/value shaped (batch, heads, seq, head_dim), got "
            f"{tuple(query.shape)} and {tuple(key.shape)}"
        )
    if query.shape[1] % key.shape[1] != 0:
        raise ValueError(
            f"query heads ({query.shape[1]}) must be a multiple of key/value heads ({key.shape[1]})"
        )
    if query.shape[2] > key.shape[2]:
        raise UnsupportedFeatureError(
            f"attn_implementation='distca' computes causal self-attention, where the queries are the last "
            f"positions of the keys, but got {query.shape[2]} queries and only {key.shape[2]} keys: "
            "cross-attention is not supported. Use attn_implementation='sdpa' for this model"
        )
    name = type(module).__name__
    _check_causal(getattr(module, "is_causal", True), name)
    _check_causal(kwargs.get("is_causal", True), f"{name} (is_causal argument)")
    config = getattr(module, "config", None)
    if config is not None:
        if getattr(config, "is_encoder_decoder", False):
            raise UnsupportedFeatureError(
                f"{name} belongs to an encoder-decoder model: cross-attention is not supported by "
                "attn_implementation='distca'; use a decoder-only model"
            )
        _check_causal(getattr(config, "is_causal", True), f"{name}'s config")
    softcap = kwargs.get("softcap")
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap < 0
    ):
        raise ValueError(f"{name}: softcap must be a positive number or None, got {softcap!r}")
    for key in ("s_aux", "sinks"):
        sinks = kwargs.get(key)
        if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.shape != (query.shape[1],)):
            shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
            raise ValueError(
                f"{name}: attention sinks ({key}) must be a tensor of one logit per query head, shaped "
                f"({query.shape[1]},), got {shape}"
            )
    sinks = kwargs.get("s_aux") if kwargs.get("s_aux") is not None else kwargs.get("sinks")
    if (softcap or sinks is not None) and torch.compiler.is_compiling():
        feature = (
            "attention sinks (gpt-oss)"
            if sinks is not None
            else f"logit softcapping (softcap={softcap}, Gemma 2)"
        )
        raise UnsupportedFeatureError(
            f"{name}: attn_implementation='distca' computes {feature} eagerly only, not inside torch.compile "
            "(its compiled custom ops do not take them yet); train this model without torch.compile"
        )
    window = kwargs.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{name}: sliding_window must be a positive int or None, got {window!r}")
    if module.training:
        _check_dropout(dropout or 0.0, name)
    if kwargs.get("output_attentions"):
        warnings.warn(
            f"{name}: output_attentions=True, but attn_implementation='distca' never materialises attention "
            "weights, so the model's `attentions` output holds none. Load the model with "
            "attn_implementation='eager' (or call model.set_attn_implementation('eager')) to get them",
            UserWarning,
            stacklevel=3,
        )


def layer_windows(config: Any) -> list[int | None]:
    """Each decoder layer's sliding window (None: full causal), as Transformers' attention modules read
    it: ``config.sliding_window`` on the layers ``layer_types`` marks "sliding_attention" (Qwen2/Qwen3,
    Gemma 3, gpt-oss), or on every layer without ``layer_types`` (Mistral)."""
    layers = getattr(config, "num_hidden_layers", 0) or 0
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return [None] * layers
    types = getattr(config, "layer_types", None)
    if types is None:
        return [int(window)] * layers
    return [int(window) if t == "sliding_attention" else None for t in types]


def _check_causal(is_causal: Any, what: str) -> None:
    if is_causal is False:
        raise UnsupportedFeatureError(
            f"{what} is non-causal (is_causal=False); attn_implementation='distca' only computes causal "
            "attention. Use attn_implementation='sdpa' for bidirectional/encoder attention"
        )


def _check_dropout(p: float, what: str) -> None:
    if p > 0:
        raise UnsupportedFeatureError(
            f"{what} trains with attention dropout (p={p}), which attn_implementation='distca' does not "
            "support; set the model config's attention_dropout=0.0"
        )
