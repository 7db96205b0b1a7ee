"""The ``distca`` attention implementation for Hugging Face Transformers.

Importing this module registers ``"distca"`` in ``transformers.AttentionInterface`` (the attention
function) and in ``transformers.masking_utils.AttentionMaskInterface`` (a mask function that only
forwards the 2-D padding mask, so padded batches can be unpadded here). Models then accept
``attn_implementation="distca"`` in ``from_pretrained`` / ``from_config`` and
``model.set_attn_implementation("distca")``.

Three modes:

- local (default): each process computes causal attention of its own batch, document by document,
  with no communication. Document boundaries come from :mod:`hf_distca.attention_inputs`, once per
  forward.
- decoding with a KV cache (``model.generate()``, or any forward whose keys outnumber its queries):
  local too; each batch row is one sequence whose queries are its last positions, attended causally
  over the whole cache (bottom-right aligned), padding masked.
- distributed: after :func:`enable_distca`, a forward that carries a ``distca_layout`` kwarg (an
  object with ``pieces`` and ``all_pieces``, produced by the integration layer) runs the balanced
  engine :func:`hf_distca.engine.core_attention` over the runtime's process group.

This is glue only: no policy lives here (the planner's price of the model's layers:
:mod:`hf_distca.engine.pricing`; the engine's probes: :mod:`hf_distca.engine.probes`). Features the kernels
cannot compute exactly are refused by :mod:`hf_distca.features` instead of being silently ignored.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from hf_distca.attention_inputs import local_batch, mask_has_padding, padding_mask, past_batch, remember_mask
from hf_distca.comm import collective_device, group_rank_world
from hf_distca.config import DistCAConfig
from hf_distca.data.nano import NANO_BATCHES
from hf_distca.engine import EngineState, core_attention, engine_state, interleave, local_attention, probe
from hf_distca.engine.compiled import compiled_core_attention, compiled_local_attention, register_runtime
from hf_distca.engine.consistency import PADDED_ROW, SEVERAL_ROWS, CallerInputError
from hf_distca.engine.pricing import with_layer_pricing
from hf_distca.features import UnsupportedFeatureError, check_attention_call
from hf_distca.packing import Unpadded, scatter_rows

__all__ = [
    "ATTN_IMPLEMENTATION",
    "LayoutLike",
    "DistCARuntime",
    "distca_attention_forward",
    "distca_padding_mask",
    "enable_distca",
]

ATTN_IMPLEMENTATION = "distca"
RUNTIME_ATTR = "distca_runtime"
_DEFAULT_CONFIG = DistCAConfig()


class LayoutLike(Protocol):
    """What the ``distca_layout`` forward kwarg must provide (e.g. :class:`hf_distca.data.DistCALayout`)."""

    pieces: Sequence[Sequence[int]]
    """This rank's ``(doc_id, doc_start, length)`` runs, in local token order."""
    all_pieces: Sequence[Sequence[Sequence[int]]]
    """Every rank's pieces (index = rank in the group), identical on all ranks."""


@dataclass(frozen=True)
class DistCARuntime:
    """Process group, engine config and engine state used by every attention module of a model (see
    :func:`enable_distca`)."""

    group: Any = None
    """Attention-server process group; None: the world (when torch.distributed is initialized)."""
    config: DistCAConfig = field(default_factory=DistCAConfig)
    state: EngineState = field(default_factory=engine_state, compare=False, repr=False)
    """What the engine remembers between calls (plans, checked layouts, probe results, ...): the process's."""
    key: int = field(init=False, compare=False, repr=False)
    """Names the runtime inside ``torch.compile`` (:func:`hf_distca.engine.compiled.register_runtime`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", register_runtime(self))

    def __deepcopy__(self, memo: dict) -> DistCARuntime:
        # process groups cannot be copied; a deep-copied model shares the runtime (and its engine state)
        return self


def enable_distca(
    model: torch.nn.Module,
    *,
    group: Any = None,
    config: DistCAConfig | None = None,
    dtype: torch.dtype | None = None,
    probe: bool = True,
) -> DistCARuntime:
    """Attach a :class:`DistCARuntime` to every submodule of ``model`` so that the ``distca`` attention
    function finds it through the module it is called with; return the runtime.

    Needed only for the distributed path (forwards carrying a ``distca_layout`` kwarg); without it the
    attention is local and never communicates. A forward without ``distca_layout`` stays local even
    after this call (only the runtime's ``config.backend`` applies). Every submodule gets it (not only the attention
    layers) so models whose attention classes follow no naming convention work too. Calling it again
    replaces the runtime. The model must use ``attn_implementation="distca"``.

    Under ``config.layer_ping_pong`` with ``layer_seconds_per_token`` None, the runtime's config gets it
    derived from the model's decoder layer (:func:`hf_distca.engine.pricing.with_layer_pricing`).

    On several ranks it runs the engine's start-up probes the config asks for
    (:func:`hf_distca.engine.probe`: ``measure_link``; ``cost_table="auto"`` on CUDA, for the model's
    head shape and attention inputs of its parameters' dtype and of ``dtype``, the dtype its attention
    layers compute in under autocast; without ``dtype``, float32 parameters are probed for bfloat16 and
    float16 too), collectively: call it on every rank of ``group`` together. ``probe=False`` skips them:
    for a model whose forwards never carry a ``distca_layout`` (the attention function runs locally,
    only ``config.backend`` applies).
    """
    config = with_layer_pricing(config if config is not None else DistCAConfig(), model)
    runtime = DistCARuntime(group=group, config=config)
    if probe:
        _probe(runtime, model, dtype)
    for module in model.modules():
        setattr(module, RUNTIME_ATTR, runtime)
    impl = getattr(getattr(model, "config", None), "_attn_implementation", ATTN_IMPLEMENTATION)
    if impl != ATTN_IMPLEMENTATION:
        warnings.warn(
            f"enable_distca: the model uses attn_implementation={impl!r}, so the runtime is unused; "
            "load it with attn_implementation='distca' or call model.set_attn_implementation('distca')",
            stacklevel=2,
        )
    return runtime


def _probe(runtime: DistCARuntime, model: torch.nn.Module, dtype: torch.dtype | None) -> None:
    """The engine's start-up probes for ``model``'s attention (see :func:`enable_distca`): on the model's
    CUDA device, else where the group's collectives run (a model still on the CPU under NCCL); for its
    parameters' dtype and ``dtype``, or, without ``dtype``, for float32 parameters also the half types
    autocast may compute in."""
    weight = next(model.parameters(), None)
    device = weight.device if weight is not None else torch.device("cpu")
    if device.type != "cuda" and group_rank_world(runtime.group)[1] > 1:
        device = collective_device(runtime.group, device)
    dtypes = [weight.dtype] if weight is not None else []
    if dtype is not None:
        dtypes.append(dtype)
    elif dtypes == [torch.float32]:
        dtypes += [torch.bfloat16, torch.float16]
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    heads = getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or (getattr(cfg, "hidden_size", 0) // heads if heads else None)
    probe(runtime.config, group=runtime.group, device=device, dtypes=dtypes, q_heads=heads, kv_heads=kv_heads,
          head_dim=head_dim, state=runtime.state)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# mask function: hand the 2-D padding mask through (Transformers passes attention_mask=None to
# attention implementations that have no registered mask function)


def distca_padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """Mask function registered as ``"distca"`` in ``AttentionMaskInterface``.

    Returns None when every key is a real token and the queries are the last ``q_length`` keys, else a
    boolean mask (B, n) with ``q_length <= n <= kv_length``: keys [0, n) of each layer are the
    sequence so far (False marks padding), keys from n on are unused slots of a static cache, and the
    queries are the last ``q_length`` of the first n keys. The causal pattern and document boundaries
    are built by the attention function itself, so ``mask_function`` is deliberately not materialised.
    """
    if kv_offset:
        # the layer's keys start at position kv_offset: a sliding-window cache dropped the earlier ones
        # once the sequence outgrew the window (or the cache follows a layout distca does not know)
        raise UnsupportedFeatureError(
            f"the KV cache holds keys from position {int(kv_offset)} on, not the whole sequence (a "
            "sliding-window cache once generation passes the window); attn_implementation='distca' decodes "
            "over the whole sequence's keys. Use attn_implementation='sdpa' to generate past the window"
        )
    if attention_mask is None:
        seen = int(q_offset) + q_length  # tokens so far: keys [0, seen) of a static cache are filled
        if seen >= kv_length:
            return None
        return torch.ones(batch_size, seen, dtype=torch.bool, device=kwargs.get("device"))  # (B, n)
    if attention_mask.dim() != 2:
        return attention_mask  # a user-built 4-D mask; the attention function refuses it clearly
    mask = attention_mask[:, -kv_length:].bool()  # (B, n), n = tokens so far
    if torch.compiler.is_compiling():
        return mask  # no host read inside a compiled region: the attention function decides
    if mask.shape[1] != kv_length:
        return mask  # keys from n on are unused slots of a static cache
    # one host read per mask tensor (the full and sliding masks of a forward are built from the same one,
    # and hf_distca.nano_batches decides the nano-batches' before their interleave starts); the layers
    # read the verdict remembered for the mask returned, never the mask
    state = engine_state()
    whole = attention_mask.dtype == torch.bool and attention_mask.shape[1] == kv_length
    if not mask_has_padding(state, attention_mask if whole else mask):
        return None
    remember_mask(state, mask, True)
    return mask


def _flat(x: torch.Tensor) -> torch.Tensor:
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b * s, h, d)  # (B, H, S, D) -> (B * S, H, D)


def _score_options(kwargs: dict) -> dict[str, Any]:
    """What the layer asks of its scores, as the engine's keyword arguments: its sliding window (Transformers
    passes it to sliding layers), logit softcapping (Gemma 2: ``softcap``) and attention sinks (gpt-oss:
    ``s_aux``, the module's ``sinks`` parameter)."""
    sinks = kwargs.get("s_aux")
    return {
        "window": kwargs.get("sliding_window"),
        "softcap": kwargs.get("softcap"),
        "sinks": kwargs.get("sinks") if sinks is None else sinks,
    }


def _run_local(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    local: Any,
    scale: float | None,
    config: DistCAConfig,
    kwargs: dict,
) -> torch.Tensor:
    """Causal attention of local documents, no communication. q: (T, Hq, D); k, v: (T, Hkv, D)."""
    if q.shape[0] == 0:
        return q * 0  # (0, Hq, D), nothing to attend (every row fully padded)
    cu = local.cu(torch.device("cpu"))  # offsets on the host: the kernels read them there
    return local_attention(
        q, k, v, cu, cu, local.max_len, local.max_len, scale=scale, backend=config.backend,
        **_score_options(kwargs),
    )  # fmt: skip


def _layout_runtime(module: torch.nn.Module) -> Any:
    """The runtime :func:`enable_distca` gave ``module``, which a forward with a ``distca_layout`` needs."""
    runtime = getattr(module, RUNTIME_ATTR, None)
    if runtime is None:
        raise RuntimeError(
            "the forward got a distca_layout but the model has no distca runtime; call "
            "hf_distca.enable_distca(model, group=...) after building the model (and on every rank)"
        )
    return runtime


def _config(module: torch.nn.Module) -> DistCAConfig:
    """The DistCAConfig :func:`enable_distca` gave ``module`` (the defaults without it)."""
    runtime = getattr(module, RUNTIME_ATTR, None)
    return runtime.config if runtime is not None else _DEFAULT_CONFIG


def _state(module: torch.nn.Module) -> EngineState:
    """The engine state of ``module``'s runtime (the process's without one)."""
    runtime = getattr(module, RUNTIME_ATTR, None)
    return runtime.state if runtime is not None else engine_state()


def _run_distributed(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    layout: Any,
    kwargs: dict,
) -> torch.Tensor:
    runtime = _layout_runtime(module)
    batch, _, seq, _ = query.shape
    # a batch of several rows or with padding can be one rank's alone: the engine raises it on every rank
    # together, at its consistency check, instead of this rank leaving the others in a collective
    problem = None
    if batch != 1:
        problem = CallerInputError(SEVERAL_ROWS)
    else:
        mask = padding_mask(attention_mask, batch, seq)
        # the verdict is read once per mask tensor, not per layer (usually decided by the mask function)
        if mask is not None and mask_has_padding(runtime.state, mask):
            problem = CallerInputError(PADDED_ROW)
    out = core_attention(
        _flat(query),
        _flat(key),
        _flat(value),
        layout.pieces,
        group=runtime.group,
        config=runtime.config,
        scale=scaling,
        all_pieces=layout.all_pieces,  # the same object for every layer: ranks are checked once per layout
        state=runtime.state,
        caller_error=problem,
        **_score_options(kwargs),  # this layer's window, softcap, sinks
    )  # (B * S, Hq, D): (S, Hq, D) unless the engine raised
    interleave.attention_done(module)  # a nano-batch resumes the rest of its layer
    return out.view(batch, seq, *out.shape[1:])  # (1, S, Hq, D)


# --------------------------------------------------------------------------------------------------
# past keys (KV-cache decoding): each row is one sequence, its queries the last positions of its keys


def _run_with_past(
    state: EngineState,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    config: DistCAConfig,
    kwargs: dict,
) -> torch.Tensor:
    """Causal attention of queries (B, Hq, S_q, D) over keys (B, Hkv, S_k, D), S_q <= S_k; no communication.

    ``mask``: None or (B, n) as returned by :func:`hf_distca.attention_inputs.padding_mask`; keys from n on are unused cache slots.
    Returns (B, S_q, Hq, D), zeros at padded queries."""
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        raise ValueError(
            f"got packed-sequence kwargs (cu_seq_lens_q/k) with {key.shape[2] - query.shape[2]} past keys; "
            "distca decodes with a KV cache one sequence per batch row. Pass padded rows and an attention_mask"
        )
    batch, num_heads, seq, head_dim = query.shape
    n = key.shape[2] if mask is None else mask.shape[1]
    past = past_batch(state, batch, seq, n, mask, query.device)
    q = _flat(query)  # (B * S_q, Hq, D)
    k, v = _flat(key[:, :, :n]), _flat(value[:, :, :n])  # (B * n, Hkv, D)
    if past.q_index is not None:
        q = q.index_select(0, past.q_index)  # (T_q, Hq, D)
        k, v = k.index_select(0, past.kv_index), v.index_select(0, past.kv_index)  # (T_k, Hkv, D)
    if q.shape[0] == 0:
        out = q * 0  # (0, Hq, D): every query is padding
    else:
        out = local_attention(
            q,
            k,
            v,
            past.cu_q,
            past.cu_k,
            max(past.q_lengths),
            max(past.kv_lengths),
            scale=scaling,
            backend=config.backend,
            **_score_options(kwargs),
        )  # (T_q, Hq, D)
    if past.q_index is not None:
        out = scatter_rows(out, Unpadded(past.q_index, past.q_lengths, batch * seq))  # (B * S_q, Hq, D)
    return out.view(batch, seq, num_heads, head_dim)  # (B, S_q, Hq, D)


# --------------------------------------------------------------------------------------------------
# inside torch.compile: every host decision moves into the engine's custom ops


def _run_compiled(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    kwargs: dict,
) -> torch.Tensor:
    """The attention function's packed paths as custom ops (:mod:`hf_distca.engine.compiled`), which read
    no tensor on the host while the compiler traces. Padded batches and KV caches stay eager-only."""
    batch, num_heads, seq, head_dim = query.shape
    if interleave.current() is not None:
        raise UnsupportedFeatureError(
            "layer-level ping-pong (DistCAConfig(layer_ping_pong=True)) switches nano-batches inside the attention "
            "function, which a compiled region cannot do; compile without it, or use ping_pong=True (attention-level)"
        )
    if key.shape[2] != seq:
        raise UnsupportedFeatureError(
            "attn_implementation='distca' inside torch.compile computes training forwards without a KV cache; "
            "pass use_cache=False, or generate without torch.compile"
        )
    if attention_mask is not None:
        raise UnsupportedFeatureError(
            "attn_implementation='distca' inside torch.compile takes packed batches without an attention_mask "
            "(DataCollatorWithFlattening, or DistCA's data path); padded batches need an eager model: drop "
            "torch.compile or the padding"
        )
    window = kwargs.get("sliding_window")  # softcap and sinks are refused here (hf_distca.features)
    q, k, v = _flat(query), _flat(key), _flat(value)  # (B * S, H, D)
    layout = kwargs.get("distca_layout")
    if layout is not None:
        runtime = _layout_runtime(module)
        token = getattr(layout, "token", None)
        if batch != 1 or token is None:
            raise ValueError(
                "inside torch.compile a distca_layout must be an hf_distca.data.DistCALayout (it carries the token "
                f"that names it to the compiled engine) with one packed row (1, S); got batch size {batch} and "
                f"a {type(layout).__name__}"
            )
        out = compiled_core_attention(q, k, v, token, runtime.key, scale=scaling, window=window)
    else:
        out = compiled_local_attention(
            q,
            k,
            v,
            batch=batch,
            cu_seq_lens=kwargs.get("cu_seq_lens_q"),
            position_ids=kwargs.get("position_ids"),
            scale=scaling,
            backend=_config(module).backend,
            window=window,
        )  # (B * S, Hq, D)
    return out.view(batch, seq, num_heads, head_dim)  # (B, S, Hq, D)


# --------------------------------------------------------------------------------------------------
# the attention function


def distca_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention function registered as ``"distca"`` in ``transformers.AttentionInterface``.

    query: (B, Hq, S, D); key, value: (B, Hkv, S_k, D) with Hq % Hkv == 0 (GQA) and S <= S_k. Returns
    ``(out, None)`` with out (B, S, Hq, D). Without past keys (S_k == S): causal within each document,
    never across documents: boundaries from ``cu_seq_lens_q/k`` (packed batch of 1 row), else
    ``position_ids``, else one document per row; a 2-D padding mask unpads each row into one document.
    With past keys (S_k > S, a KV cache): each row is one sequence whose queries are its last S
    positions, causal over the whole row. Padded outputs are 0. A ``distca_layout`` kwarg selects the
    distributed engine (needs :func:`enable_distca`).
    """
    check_attention_call(module, query, key, dropout, kwargs)
    if NANO_BATCHES in kwargs:
        raise ValueError(
            f"the forward got a micro-batch of layer ping-pong nano-batches ({NANO_BATCHES!r}); run it with "
            "hf_distca.nano_batch_loss(model, batch) (or DistCATrainer), which runs each nano-batch's forward"
        )
    if torch.compiler.is_compiling():
        return _run_compiled(module, query, key, value, attention_mask, scaling, kwargs), None
    batch, num_heads, seq, head_dim = query.shape
    layout = kwargs.get("distca_layout")
    if layout is not None:
        if key.shape[2] != seq:
            raise ValueError(
                f"a forward with a distca_layout got {key.shape[2] - seq} past keys from a KV cache; training "
                "forwards attend within their own tokens: pass use_cache=False (or model.config.use_cache=False)"
            )
        out = _run_distributed(module, query, key, value, attention_mask, scaling, layout, kwargs)
        return out, None

    config = _config(module)
    state = _state(module)
    mask = padding_mask(attention_mask, batch, seq, key.shape[2])
    if key.shape[2] != seq or (mask is not None and mask.shape[1] != seq):
        return _run_with_past(state, query, key, value, mask, scaling, config, kwargs), None

    local = local_batch(state, batch, seq, mask, kwargs)
    q, k, v = _flat(query), _flat(key), _flat(value)  # (B * S, H, D)
    if local.unpadded is not None:
        idx = local.unpadded.indices
        q, k, v = q.index_select(0, idx), k.index_select(0, idx), v.index_select(0, idx)  # (T, H, D)
    out = _run_local(q, k, v, local, scaling, config, kwargs)  # (T, Hq, D)
    if local.unpadded is not None:
        out = scatter_rows(out, local.unpadded)  # (B * S, Hq, D), zeros at padding
    return out.view(batch, seq, num_heads, head_dim), None  # (B, S, Hq, D)


def _register() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, distca_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, distca_padding_mask)


_register()
