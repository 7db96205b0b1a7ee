"""Transformers linear-attention modules replaced by sequence-parallel ones, through public module APIs.

Transformers has no registry for linear attention (``AttentionInterface`` only covers softmax attention),
so :func:`enable_linear_attention_sp` swaps each supported module instance of a model for a replacement
that shares its parameters and buffers (same names: checkpoints load and save unchanged). Softmax layers
are untouched: give them ``attn_implementation="distca"`` and :func:`hf_distca.enable_distca`.

Supported: MiniMax (``MiniMaxLightningAttention``) and Qwen3-Next (``Qwen3NextGatedDeltaNet``; its decoder
layer also gets a forward pre-hook that passes ``position_ids`` on to the replacement, see
:func:`hf_distca.linear.layers.qwen3_next.pass_position_ids`).
"""

from __future__ import annotations

from torch import nn

from hf_distca.linear.config import LinearSPConfig
from hf_distca.linear.layers.minimax import MiniMaxLightningAttentionSP
from hf_distca.linear.layers.qwen3_next import Qwen3NextGatedDeltaNetSP, pass_position_ids

__all__ = [
    "MiniMaxLightningAttentionSP",
    "Qwen3NextGatedDeltaNetSP",
    "enable_linear_attention_sp",
    "supported_linear_modules",
]


def supported_linear_modules() -> dict[type, type]:
    """Transformers linear-attention classes that have a sequence-parallel replacement -> replacement."""
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    return {
        MiniMaxLightningAttention: MiniMaxLightningAttentionSP,
        Qwen3NextGatedDeltaNet: Qwen3NextGatedDeltaNetSP,
    }


def enable_linear_attention_sp(model: nn.Module, *, group=None, config: LinearSPConfig | None = None) -> int:
    """Replace every supported linear-attention module of ``model`` in place; return how many.

    ``group``: the process group the documents are cut over (the same as ``enable_distca``'s); None: the
    default group. Calling it again updates the group and config of already replaced modules. Sets
    ``model.config.use_cache = False``: the replacements keep no decoding cache (training only).
    """
    config = config if config is not None else LinearSPConfig()
    replacements = supported_linear_modules()
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, tuple(replacements.values())):
                child.linear_sp_group, child.linear_sp_config = group, config
                count += 1
            elif type(child) in replacements:
                replacement = replacements[type(child)](child, group=group, config=config)
                setattr(parent, name, replacement)
                if isinstance(replacement, Qwen3NextGatedDeltaNetSP):
                    pass_position_ids(parent)  # its decoder layer keeps position_ids to itself
                count += 1
    if count == 0:
        names = ", ".join(cls.__name__ for cls in replacements)
        raise ValueError(
            f"{type(model).__name__} has no supported linear-attention module (supported: {names}); "
            "hybrid models such as MiniMax (MiniMaxForCausalLM) and Qwen3-Next (Qwen3NextForCausalLM) are"
        )
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False
    return count
