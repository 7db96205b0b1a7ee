"""Transformers linear-attention modules replaced by sequence-parallel ones, through public module APIs.

Transformers has no registry for linear attention (``AttentionInterface`` only covers softmax attention),
so :func:`enable_linear_attention_sp` swaps each supported module instance of a model for a replacement
that shares its parameters and buffers (same names: checkpoints load and save unchanged). Softmax layers
are untouched: give them ``attn_implementation="distca"`` and :func:`hf_distca.enable_distca`.

Supported: MiniMax (``MiniMaxLightningAttention``), Qwen3-Next (``Qwen3NextGatedDeltaNet``) and OLMo-hybrid
(``OlmoHybridGatedDeltaNet``); the decoder layer of a gated DeltaNet also gets a forward pre-hook that
passes ``position_ids`` on to the replacement, see
:func:`hf_distca.linear.layers.gated_deltanet.pass_position_ids`.
"""

from __future__ import annotations

from torch import nn

from hf_distca.linear.config import LinearSPConfig
from hf_distca.linear.layers.gated_deltanet import GatedDeltaNetSP, pass_position_ids
from hf_distca.linear.layers.minimax import MiniMaxLightningAttentionSP
from hf_distca.linear.layers.olmo_hybrid import OlmoHybridGatedDeltaNetSP
from hf_distca.linear.layers.qwen3_next import Qwen3NextGatedDeltaNetSP
from hf_distca.linear.ops.local import prepare_backend

__all__ = [
    "GatedDeltaNetSP",
    "MiniMaxLightningAttentionSP",
    "OlmoHybridGatedDeltaNetSP",
    "Qwen3NextGatedDeltaNetSP",
    "enable_linear_attention_sp",
    "supported_linear_modules",
]


def supported_linear_modules() -> dict[type, type]:
    """Transformers linear-attention classes that have a sequence-parallel replacement -> replacement."""
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention
    from transformers.models.olmo_hybrid.modeling_olmo_hybrid import OlmoHybridGatedDeltaNet
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    return {
        MiniMaxLightningAttention: MiniMaxLightningAttentionSP,
        Qwen3NextGatedDeltaNet: Qwen3NextGatedDeltaNetSP,
        OlmoHybridGatedDeltaNet: OlmoHybridGatedDeltaNetSP,
    }


def enable_linear_attention_sp(model: nn.Module, *, group=None, config: LinearSPConfig | None = None) -> int:
    """Replace every supported linear-attention module of ``model`` in place; return how many.

    ``group``: the process group the documents are cut over (the same as ``enable_distca``'s); None: the
    default group. Calling it again updates the group and config of already replaced modules. Sets
    ``model.config.use_cache = False``: the replacements keep no decoding cache (training only).

    The local backend is chosen here for the current CUDA device (``prepare_backend``; CPU without
    CUDA) and each layer's transition, and kept as ``linear_sp_backend`` on every replaced module: an
    explicit ``backend='fla'`` that fla would get wrong on this GPU and Triton raises a ValueError now,
    'auto' falls back to 'chunked' there.
    """
    config = config if config is not None else LinearSPConfig()
    replacements = supported_linear_modules()
    found = [
        (parent, name, child)
        for parent in list(model.modules())
        for name, child in list(parent.named_children())
        if isinstance(child, tuple(replacements.values())) or type(child) in replacements
    ]
    kinds = {replacements.get(type(child), child).linear_kind for *_, child in found}
    chosen = {
        kind: prepare_backend(config.backend, kind) for kind in sorted(kinds)
    }  # raises before any change
    for parent, name, child in found:
        if type(child) in replacements:
            replacement = replacements[type(child)](child, group=group, config=config)
            setattr(parent, name, replacement)
            if isinstance(replacement, GatedDeltaNetSP):
                pass_position_ids(parent)  # its decoder layer keeps position_ids to itself
        else:
            child.linear_sp_group, child.linear_sp_config = group, config
            child.linear_sp_backend = chosen[child.linear_kind]
    count = len(found)
    if count == 0:
        names = ", ".join(cls.__name__ for cls in replacements)
        raise ValueError(
            f"{type(model).__name__} has no supported linear-attention module (supported: {names}); "
            "load a hybrid model with one of these layers (MiniMaxForCausalLM, Qwen3NextForCausalLM, "
            "OlmoHybridForCausalLM); softmax-only models need only attn_implementation='distca'"
        )
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False
    return count
