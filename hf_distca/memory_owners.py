"""Where a training step's memory goes, by owner: the accounting behind a memory benchmark's breakdown.

:func:`memory_by_owner` adds up what each owner holds at the peak of a step from the sizes it is known to
have, not from the allocator: the weights, their gradients and the optimizer's states (the tensors
themselves), one micro-batch's checkpointed layer inputs and the attention outputs that
rematerialization-aware checkpointing keeps (tokens x shape, placed as the offload's per-layer policy says:
on the device, in host memory, or dropped). What the peak holds beyond them on the device is the rest:
one layer's recompute and backward working set, the loss, the allocator's pieces in use. Gradients are
counted whole (backward reaches its peak with most of them allocated); a negative rest says the owners
were not all live at the peak.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_distca import kept_attention as kept
from hf_distca.offloading import OFFLOAD_ATTR, decoder_layers, local_numel

__all__ = ["memory_by_owner"]

GIB = 2**30


def _tensor_bytes(tensors) -> int:
    return sum(local_numel(t) * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _optimizer_tensors(optimizer: Any):
    for state in getattr(optimizer, "state", {}).values():
        if isinstance(state, dict):
            yield from (v for v in state.values() if isinstance(v, torch.Tensor) and local_numel(v) > 1)


def memory_by_owner(
    model: torch.nn.Module,
    optimizer: Any = None,
    *,
    tokens: int,
    compute_dtype: torch.dtype,
    remat: bool,
    peak_allocated: int | None = None,
) -> dict[str, float | None]:
    """GiB held by each owner of one rank's step of micro-batches of ``tokens`` rows (see the module
    docstring). ``remat``: rematerialization-aware checkpointing keeps attention outputs (in
    ``compute_dtype``); the offload installed on ``model`` (``model.distca_offload``) says where inputs and
    kept outputs are. ``peak_allocated``: the step's peak allocated device bytes, for the rest (None: no
    device figures, e.g. the CPU)."""
    params = [p for p in model.parameters()]
    weights = _tensor_bytes(params)
    gradients = sum(local_numel(p) * p.element_size() for p in params if p.requires_grad)
    states = _tensor_bytes(_optimizer_tensors(optimizer)) if optimizer is not None else 0
    layers = decoder_layers(model)
    checkpointed = sum(bool(getattr(layer, "gradient_checkpointing", False)) for layer in layers)
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", 0) or 0
    heads = getattr(config, "num_attention_heads", 0) or 0
    head_dim = getattr(config, "head_dim", None) or hidden // max(heads, 1)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    residual = getattr(getattr(embeddings, "weight", None), "dtype", None) or params[0].dtype
    input_bytes = tokens * hidden * torch.empty((), dtype=residual).element_size()
    offload = getattr(model, OFFLOAD_ATTR, None)
    inputs_host = sum(offload.inputs_policy) if offload is not None and offload.inputs_policy else 0
    policy = list(offload.policy) if offload is not None and offload.policy is not None else None
    placement = (policy or ["gpu"] * checkpointed) if remat and checkpointed else []
    kept_bytes = kept.kept_attention_bytes(tokens, heads, head_dim, compute_dtype)
    out: dict[str, float | None] = {
        "weights_gib": weights / GIB,
        "gradients_gib": gradients / GIB,
        "optimizer_state_gib": states / GIB,
        "checkpointed_inputs_gpu_gib": (checkpointed - inputs_host) * input_bytes / GIB,
        "checkpointed_inputs_host_gib": inputs_host * input_bytes / GIB,
        **{
            f"kept_attention_{where}_gib": placement.count(where) * kept_bytes / GIB
            for where in ("gpu", "host")
        },
        "kept_attention_dropped_gib": placement.count("drop") * kept_bytes / GIB,
    }
    on_device = (
        out["weights_gib"]
        + out["gradients_gib"]
        + out["optimizer_state_gib"]
        + out["checkpointed_inputs_gpu_gib"]
        + out["kept_attention_gpu_gib"]
    )
    out["rest_gib"] = None if peak_allocated is None else peak_allocated / GIB - on_device
    return out
