"""What ``attn_implementation="distca"`` refuses: the one place that decides it.

The distca kernels compute plain causal softmax attention, document by document. A model feature that
changes that math (bidirectional or cross-attention, logit softcapping, attention sinks, attention
dropout in training, a sliding window shorter than a document) would be silently ignored, so it is
refused with :class:`UnsupportedFeatureError` instead. Two entry points share the checks and their
messages:

- :func:`check_model_config`: before training (the callback's pre-flight), from the model config and
  the longest document a micro-batch can hold;
- :func:`check_attention_call`: on every call of the attention function, from the module and the
  keyword arguments Transformers passes; :func:`check_window` once document lengths are known.

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
    "check_window",
]

_SOFTCAP_KEYS = ("attn_logit_softcapping", "attn_softcap")


def check_model_config(config: Any, *, model_name: str, max_document_tokens: int) -> None:
    """Pre-flight: refuse a model whose attention distca cannot compute exactly.

    ``max_document_tokens``: the longest document a micro-batch can hold (tokens_per_rank x world size);
    a sliding window at least that long never cuts a document, so it is exact.
    """
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedFeatureError(
            f"{model_name} is an encoder-decoder model: cross-attention is not supported by "
            "attn_implementation='distca'; use a decoder-only model"
        )
    _check_causal(getattr(config, "is_causal", True), f"{model_name}'s config")
    for key in _SOFTCAP_KEYS:
        _check_softcap(getattr(config, key, None), f"{model_name} ({key})")
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) is not False:
        check_window(window, max_document_tokens, pre_flight=True)
    _check_dropout(getattr(config, "attention_dropout", 0.0) or 0.0, model_name)


def check_attention_call(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, dropout: float, kwargs: dict
) -> None:
    """Per call of the attention function: shapes, and every feature the call asks for.

    query: (B, Hq, S_q, D); key: (B, Hkv, S_k, D) with S_q <= S_k (keys beyond the queries are past keys
    from a KV cache). The sliding window is checked later, with :func:`check_window`, once document
    lengths are known.
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
        raise UnsupportedFeatureError(
            f"{name} uses attention sinks (s_aux), which attn_implementation='distca' does not support; use "
            "attn_implementation='eager' for this model"
        )
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


def check_window(sliding_window: int | None, longest: int, *, pre_flight: bool = False) -> None:
    """Refuse a sliding window shorter than the longest document.

    Transformers' sliding window lets query i see key j when i - j < window, so it never cuts a
    document of at most ``window`` tokens: causal attention over it is exactly sliding-window attention.
    """
    if sliding_window is None or longest <= sliding_window:
        return
    subject = (
        f"documents may reach {longest} tokens (tokens_per_rank x world size), which"
        if pre_flight
        else f"a document of {longest} tokens"
    )
    raise UnsupportedFeatureError(
        f"{subject} is longer than the model's sliding window (sliding_window={sliding_window}); "
        "sliding-window attention is not supported by attn_implementation='distca'. Keep documents at most "
        f"{sliding_window} tokens (tokens_per_rank x world size <= {sliding_window}), or set the config's "
        "sliding_window=None (use_sliding_window=False) to train with full causal attention"
    )


def _check_causal(is_causal: Any, what: str) -> None:
    if is_causal is False:
        raise UnsupportedFeatureError(
            f"{what} is non-causal (is_causal=False); attn_implementation='distca' only computes causal "
            "attention. Use attn_implementation='sdpa' for bidirectional/encoder attention"
        )


def _check_softcap(softcap: float | None, what: str) -> None:
    if softcap:
        raise UnsupportedFeatureError(
            f"{what} uses attention logit softcapping (softcap={softcap}), which attn_implementation='distca' "
            "does not support; use attn_implementation='eager' or 'sdpa' for this model"
        )


def _check_dropout(p: float, what: str) -> None:
    if p > 0:
        raise UnsupportedFeatureError(
            f"{what} trains with attention dropout (p={p}), which attn_implementation='distca' does not "
            "support; set the model config's attention_dropout=0.0"
        )
