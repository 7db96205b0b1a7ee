"""What ``attn_implementation="distca"`` refuses: the one place that decides it.

The distca kernels compute causal softmax attention, document by document, optionally inside a sliding
window (each layer's ``sliding_window``: Mistral, Qwen2/Qwen3 with ``use_sliding_window``, Gemma 3's local
layers). A model feature that changes that math would be silently ignored, so it is refused with
:class:`UnsupportedFeatureError` instead: bidirectional or cross-attention, attention logit softcapping
(Gemma 2: ``attn_logit_softcapping``), attention sinks (gpt-oss: ``s_aux``), attention dropout in
training. Two entry points share the checks and their messages:

- :func:`check_model_config`: before training (the callback's pre-flight), from the model config;
- :func:`check_attention_call`: on every call of the attention function, from the module and the
  keyword arguments Transformers passes.

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

_SOFTCAP_KEYS = ("attn_logit_softcapping", "attn_softcap")


def check_model_config(config: Any, *, model_name: str) -> None:
    """Pre-flight: refuse a model whose attention distca cannot compute exactly (sliding windows of any
    length are computed exactly)."""
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedFeatureError(
            f"{model_name} is an encoder-decoder model: cross-attention is not supported by "
            "attn_implementation='distca'; use a decoder-only model"
        )
    _check_causal(getattr(config, "is_causal", True), f"{model_name}'s config")
    for key in _SOFTCAP_KEYS:
        _check_softcap(getattr(config, key, None), f"{model_name} ({key})")
    if getattr(config, "model_type", None) == "gpt_oss":
        _refuse_sinks(model_name)
    _check_dropout(getattr(config, "attention_dropout", 0.0) or 0.0, model_name)


def check_attention_call(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, dropout: float, kwargs: dict
) -> None:
    """Per call of the attention function: shapes, and every feature the call asks for.

    query: (B, Hq, S_q, D); key: (B, Hkv, S_k, D) with S_q <= S_k (keys beyond the queries are past keys
    from a KV cache). ``sliding_window`` must be None or a positive int.
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
    _check_softcap(kwargs.get("softcap"), name)
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        _refuse_sinks(name)
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


def _refuse_sinks(what: str) -> None:
    raise UnsupportedFeatureError(
        f"{what} uses attention sinks (s_aux: a learned per-head logit in every softmax, gpt-oss), which "
        "no distca kernel computes (reference, torch_varlen, cudnn, flash_attn): they would be silently "
        "dropped. Use attn_implementation='eager' (or a kernels-hub flash attention with sinks) for this model"
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


def _check_softcap(softcap: float | None, what: str) -> None:
    if softcap:
        raise UnsupportedFeatureError(
            f"{what} uses attention logit softcapping (softcap={softcap}: scores squashed by softcap x "
            "tanh(score / softcap), Gemma 2), which no distca kernel computes (reference, torch_varlen, cudnn, "
            "flash_attn); use attn_implementation='eager' (or 'flash_attention_2', which computes it) for "
            "this model. Gemma 3 has none (attn_logit_softcapping=None) and trains with distca"
        )


def _check_dropout(p: float, what: str) -> None:
    if p > 0:
        raise UnsupportedFeatureError(
            f"{what} trains with attention dropout (p={p}), which attn_implementation='distca' does not "
            "support; set the model config's attention_dropout=0.0"
        )
