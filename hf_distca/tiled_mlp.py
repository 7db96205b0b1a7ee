"""Tiled position-wise modules: each decoder layer's MLP and norms run over token tiles, keeping only
their input for backward.

A Llama-style MLP's intermediate activations (tokens x intermediate size, three of them for SwiGLU) are its
largest tensors at long sequence lengths; at 512K tokens they dwarf the layer's input. A norm that computes
in float32 (Llama's RMSNorm upcasts its input) saves a float32 copy of its input and a normalized copy, three
times the input's bytes in bf16, and its backward makes several more float32 temporaries of that size.
:func:`tile_mlp` and :func:`tile_norms` replace each decoder layer's ``mlp`` (its norms, and the model's final
norm) by a :class:`TiledModule` (a module swap through ``setattr``) whose forward runs the original module
over tiles of ``tile_tokens`` tokens inside one autograd function that saves only the input; its backward
runs each tile again under autograd and takes the gradients of the input and of the module's parameters
tile by tile (``torch.autograd.grad``), summed (in float32 for 16-bit parameters) into one gradient per
parameter that the function returns (so each parameter receives one gradient per backward, as DDP and
gradient accumulation expect). The result equals the untiled computation up to floating-point
reassociation: the parameter gradients are sums of per-tile gradients (accumulated in float32), and a
kernel (on CUDA) may reduce a tile in another order than the whole sequence, so it is not guaranteed
bit-identical.

The wrapper shares the original module's dictionaries of children, parameters and buffers (the original
is kept outside the module tree): one set of parameters, so ``state_dict`` keys and parameter objects are
unchanged (checkpoints load into the tiled and the plain model alike, an optimizer built before the swap
keeps working), and whatever replaces a parameter afterwards through the wrapper (FSDP2's ``fully_shard``,
``load_state_dict(assign=True)``, ``setattr``) replaces it in the module that computes.

Inside an activation checkpoint the input is saved by a separate pass-through function just before the
tiled computation, which saves nothing: when nothing after the MLP in the layer saves a tensor (Llama's
residual add saves none), the checkpoint's recompute stops early (torch's non-reentrant checkpoint stops
once every saved tensor is refilled, its default) before the MLP, so backward runs the MLP once per tile,
not twice. Where something after it does save (e.g. a post-MLP norm), the recompute runs through the
tiled forward as usual: which one happens is torch's own count of saved tensors, never a guess. An
input that does not require grad (frozen embeddings before the first norm) has no anchor (a function none of
whose inputs requires grad gets no graph node): the tiled function saves it itself (inside a checkpoint the
recompute then runs through the tiled forward), and its backward takes the parameters' gradients only.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = [
    "TiledMLP",
    "TiledModule",
    "TiledNorm",
    "tile_mlp",
    "tile_norms",
    "tiled_mlp_report",
    "untile_mlp",
    "untile_norms",
]


class _Anchor(torch.autograd.Function):
    """Passes the tiled module's input (one that requires grad) through and saves it: the one tensor the
    tiled module keeps for backward."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad


def _tiles(rows: int, tile_rows: int) -> list[tuple[int, int]]:
    """[start, end) of the tiles of ``rows`` rows: ceil(rows / tile_rows) tiles of equal size (+-1)."""
    count = max(1, -(-rows // tile_rows))
    bounds = [rows * i // count for i in range(count + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def _run_tiles(module: torch.nn.Module, flat: torch.Tensor, tiles: list[tuple[int, int]]) -> torch.Tensor:
    """The module of every row of ``flat`` (N, H), one tile at a time, into one (N, H_out) tensor."""
    out = None
    for start, end in tiles:
        part = module(flat[start:end])  # (rows, H_out)
        if not isinstance(part, torch.Tensor):
            raise TypeError(
                f"tiling: {type(module).__name__} returns {type(part).__name__}, not a tensor (a mixture of experts "
                "returning router logits?); only position-wise modules can be tiled"
            )
        if out is None:
            out = part.new_empty(flat.shape[0], part.shape[-1])  # (N, H_out)
        out[start:end] = part
    return out


def _accumulator(grad: torch.Tensor) -> torch.Tensor:
    """A running sum for a parameter's per-tile gradients: float32 for 16-bit gradients (so that summing
    hundreds of tiles does not round at every addition), else the gradient itself."""
    return grad.float() if grad.dtype in (torch.float16, torch.bfloat16) else grad


class _TiledFunction(torch.autograd.Function):
    """y = module(x) over token tiles; saves nothing itself when ``anchor`` (the anchor's graph node) holds
    the input, else saves the input."""

    @staticmethod
    def forward(ctx, x, anchor, mlp, tile_rows, *params):  # type: ignore[override]
        ctx.anchor, ctx.mlp, ctx.tile_rows, ctx.params = anchor, mlp, tile_rows, params
        if anchor is None:
            ctx.save_for_backward(x)
        where = x.device.type
        # backward reruns the tiles under the autocast forward ran in (the engine runs backward outside it)
        ctx.autocast = dict(
            device_type=where,
            enabled=torch.is_autocast_enabled(where),
            dtype=torch.get_autocast_dtype(where),
            cache_enabled=torch.is_autocast_cache_enabled(),
        )
        flat = x.reshape(-1, x.shape[-1])  # (N, H)
        out = _run_tiles(mlp, flat, _tiles(flat.shape[0], tile_rows))  # (N, H_out)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        # inside a checkpoint: this refills it (the recompute)
        (x,) = ctx.saved_tensors if ctx.anchor is None else ctx.anchor.saved_tensors
        flat = x.reshape(-1, x.shape[-1])  # (N, H)
        grad_flat = grad_out.reshape(-1, grad_out.shape[-1])  # (N, H_out)
        trained = [p for p in ctx.params if p.requires_grad]
        wants_dx = ctx.needs_input_grad[0]
        dx = torch.empty_like(flat) if wants_dx else None  # (N, H)
        sums: list[torch.Tensor | None] = [None] * len(trained)
        with torch.enable_grad(), torch.autocast(**ctx.autocast):
            for start, end in _tiles(flat.shape[0], ctx.tile_rows):
                tile = flat[start:end].detach().requires_grad_(wants_dx)  # (rows, H)
                # a non-leaf like the forward's tile: autocast casts it at each use (it caches leaves' casts)
                part = ctx.mlp(tile.view_as(tile))  # (rows, H_out)
                inputs = [tile, *trained] if wants_dx else trained
                grads = torch.autograd.grad(part, inputs, grad_flat[start:end], allow_unused=True)
                if wants_dx:
                    dx[start:end], grads = grads[0], grads[1:]
                for i, g in enumerate(grads):
                    if g is not None:
                        sums[i] = _accumulator(g) if sums[i] is None else sums[i].add_(g)
        sums = [None if g is None else g.to(p.dtype) for g, p in zip(sums, trained)]
        by_param = dict(zip(map(id, trained), sums))
        param_grads = [by_param.get(id(p)) for p in ctx.params]
        return (dx.view_as(x) if wants_dx else None, None, None, None, *param_grads)


class TiledModule(torch.nn.Module):
    """``original`` (a position-wise module: each row of its output depends on the same row of its input
    only) run over tiles of ``tile_tokens`` tokens (see the module docstring); the same parameter, buffer
    and child dictionaries as ``original``, so the same parameters and ``state_dict`` keys."""

    def __init__(self, original: torch.nn.Module, tile_tokens: int) -> None:
        super().__init__()
        if not isinstance(tile_tokens, int) or tile_tokens < 1:
            raise ValueError(f"{type(self).__name__} tile_tokens must be a positive int, got {tile_tokens!r}")
        object.__setattr__(self, "original", original)  # outside the module tree: keys stay the module's
        # the same dict objects, never copies: a parameter set on either module is the other's
        for shared in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
            object.__setattr__(self, shared, getattr(original, shared))
        self.tile_tokens = tile_tokens

    def train(self, mode: bool = True) -> TiledModule:
        """Set the mode of the wrapper, its children and ``original`` (outside the module tree)."""
        super().train(mode)
        self.original.training = mode  # the module that computes (its children are shared)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            flat = x.reshape(-1, x.shape[-1])  # (N, H)
            out = _run_tiles(self.original, flat, _tiles(flat.shape[0], self.tile_tokens))
            return out.view(*x.shape[:-1], out.shape[-1])
        params = tuple(self.original.parameters())
        if not x.requires_grad:  # no anchor node (see the module docstring): the tiled function saves x
            return _TiledFunction.apply(x, None, self.original, self.tile_tokens, *params)
        anchored = _Anchor.apply(x)
        return _TiledFunction.apply(anchored, anchored.grad_fn, self.original, self.tile_tokens, *params)

    def extra_repr(self) -> str:
        return f"tile_tokens={self.tile_tokens}, original={type(self.original).__name__}"


class TiledMLP(TiledModule):
    """A decoder layer's MLP over token tiles (:func:`tile_mlp`)."""


class TiledNorm(TiledModule):
    """A norm over the last dimension (RMSNorm, LayerNorm) over token tiles (:func:`tile_norms`)."""


def _layers_with_mlp(model: torch.nn.Module) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [
        m
        for m in model.modules()
        if isinstance(m, GradientCheckpointingLayer) and isinstance(getattr(m, "mlp", None), torch.nn.Module)
    ]


def _tile_tokens(model: torch.nn.Module, tile_tokens: int | None, caller: str) -> int:
    if tile_tokens is None:
        tile_tokens = getattr(getattr(model, "config", None), "hidden_size", None)
        if not tile_tokens:
            raise ValueError(f"{caller}: the model's config has no hidden_size; give tile_tokens")
    return int(tile_tokens)


def tile_mlp(model: torch.nn.Module, tile_tokens: int | None = None) -> int:
    """Swap every decoder layer's ``mlp`` for a :class:`TiledMLP` of ``tile_tokens`` tokens per tile (None:
    the model's ``hidden_size``, as DeepSpeed's ALST tiles it: each tile's intermediate activations are then
    about the size of the layer's weights). Calling it again re-tiles. Returns how many MLPs were tiled."""
    layers = _layers_with_mlp(model)
    if not layers:
        raise ValueError(
            f"tile_mlp: {type(model).__name__} has no decoder layers (Transformers GradientCheckpointingLayer) "
            "with an `mlp` module to tile"
        )
    tile_tokens = _tile_tokens(model, tile_tokens, "tile_mlp")
    for layer in layers:
        mlp = layer.mlp.original if isinstance(layer.mlp, TiledMLP) else layer.mlp
        if any(hasattr(mlp, name) for name in ("experts", "router")):
            raise ValueError(
                f"tile_mlp: {type(mlp).__name__} is a mixture of experts (routing depends on the whole batch); "
                "only position-wise MLPs can be tiled exactly"
            )
        layer.mlp = TiledMLP(mlp, int(tile_tokens))
    return len(layers)


def untile_mlp(model: torch.nn.Module) -> int:
    """Undo :func:`tile_mlp`: every :class:`TiledMLP` back to its original module. Returns how many."""
    count = 0
    for layer in _layers_with_mlp(model):
        if isinstance(layer.mlp, TiledMLP):
            layer.mlp = layer.mlp.original
            count += 1
    return count


def _is_norm(module: torch.nn.Module) -> bool:
    """A norm over the last dimension: a ``torch.nn.LayerNorm`` of one normalized dimension, or a module
    with a class named ``...RMSNorm`` / ``...LayerNorm`` along its MRO (Transformers' norms, and Liger's
    that replace them, e.g. ``LigerRMSNormForGemma(LigerRMSNorm)``) with a 1-D weight or none, whose
    forward takes the hidden states alone (not a fused residual add or a modulation)."""
    if isinstance(module, torch.nn.LayerNorm):
        return len(module.normalized_shape) == 1
    if not any(cls.__name__.endswith(("RMSNorm", "LayerNorm")) for cls in type(module).__mro__):
        return False
    weight = getattr(module, "weight", None)
    return (weight is None or weight.dim() == 1) and _required_positional_args(module.forward) == 1


def _required_positional_args(forward: Any) -> int:
    """How many positional arguments without a default ``forward`` (a bound method) requires."""
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read: assume the hidden states alone
        return 1
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in positional and p.default is inspect.Parameter.empty for p in parameters)


def _norm_slots(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """(parent, attribute) of every norm that is a direct child of a decoder layer or of the module holding
    the decoder layers (the final norm), in module order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    slots = []
    for parent in model.modules():
        layers = getattr(parent, "layers", None)
        holds_layers = isinstance(layers, torch.nn.ModuleList) and any(
            isinstance(layer, GradientCheckpointingLayer) for layer in layers
        )
        if not (isinstance(parent, GradientCheckpointingLayer) or holds_layers):
            continue
        for name, child in parent.named_children():
            norm = child.original if isinstance(child, TiledNorm) else child
            if _is_norm(norm):
                slots.append((parent, name))
    return slots


def tile_norms(model: torch.nn.Module, tile_tokens: int | None = None) -> int:
    """Swap every norm of the decoder layers (e.g. Llama's ``input_layernorm``, ``post_attention_layernorm``)
    and the model's final norm for a :class:`TiledNorm` of ``tile_tokens`` tokens per tile (None: the
    model's ``hidden_size``): only their input is kept for backward, and their float32 temporaries exist
    for one tile at a time. Calling it again re-tiles. Returns how many norms were tiled."""
    slots = _norm_slots(model)
    if not slots:
        raise ValueError(
            f"tile_norms: {type(model).__name__} has no RMSNorm/LayerNorm modules over the last dimension in its "
            "decoder layers (Transformers GradientCheckpointingLayer) to tile"
        )
    tile_tokens = _tile_tokens(model, tile_tokens, "tile_norms")
    for parent, name in slots:
        norm = getattr(parent, name)
        setattr(parent, name, TiledNorm(norm.original if isinstance(norm, TiledNorm) else norm, tile_tokens))
    return len(slots)


def untile_norms(model: torch.nn.Module) -> int:
    """Undo :func:`tile_norms`. Returns how many norms went back to their original module."""
    slots = [
        (parent, name) for parent, name in _norm_slots(model) if isinstance(getattr(parent, name), TiledNorm)
    ]
    for parent, name in slots:
        setattr(parent, name, getattr(parent, name).original)
    return len(slots)


def tiled_mlp_report(model: torch.nn.Module) -> dict[str, Any]:
    """Tiled MLPs and norms of ``model`` and their tile sizes (for reports)."""
    tiled = [layer.mlp for layer in _layers_with_mlp(model) if isinstance(layer.mlp, TiledMLP)]
    norms = [m for m in model.modules() if isinstance(m, TiledNorm)]
    return {
        "tiled_mlps": len(tiled),
        "tiled_mlp_tokens": tiled[0].tile_tokens if tiled else None,
        "tiled_norms": len(norms),
        "tiled_norm_tokens": norms[0].tile_tokens if norms else None,
    }
