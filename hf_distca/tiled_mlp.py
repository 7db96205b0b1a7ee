"""Tiled MLP: each decoder layer's MLP run over token tiles, keeping only its input for backward.

A Llama-style MLP's intermediate activations (tokens x intermediate size, three of them for SwiGLU) are its
largest tensors at long sequence lengths; at 512K tokens they dwarf the layer's input. :func:`tile_mlp`
replaces each decoder layer's ``mlp`` by a :class:`TiledMLP` (a module swap through ``setattr``) whose
forward runs the original module over tiles of ``tile_tokens`` tokens inside one autograd function that
saves only the input; its backward runs each tile again under autograd and takes the gradients of the
input and of the MLP's parameters tile by tile (``torch.autograd.grad``), summed into one gradient per
parameter that the function returns (so each parameter receives one gradient per backward, as DDP and
gradient accumulation expect). Exact up to the summation order of the parameter gradients.

The wrapper registers the original module's children, parameters and buffers as its own (the original is
kept outside the module tree), so ``state_dict`` keys and parameter objects are unchanged: checkpoints load
into the tiled and the plain model alike, and an optimizer built before the swap keeps working.

Inside an activation checkpoint the input is saved by a separate pass-through function just before the
tiled computation, which saves nothing: when nothing after the MLP in the layer saves a tensor (Llama's
residual add saves none), the checkpoint's recompute stops early (torch's non-reentrant checkpoint stops
once every saved tensor is refilled, its default) before the MLP, so backward runs the MLP once per tile,
not twice. Where something after it does save (e.g. a post-MLP norm), the recompute runs through the
tiled forward as usual: which one happens is torch's own count of saved tensors, never a guess.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["TiledMLP", "tile_mlp", "tiled_mlp_report", "untile_mlp"]


class _Anchor(torch.autograd.Function):
    """Passes the MLP input through and saves it: the one tensor the tiled MLP keeps for backward."""

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


def _run_tiles(mlp: torch.nn.Module, flat: torch.Tensor, tiles: list[tuple[int, int]]) -> torch.Tensor:
    """The MLP of every row of ``flat`` (N, H), one tile at a time, into one (N, H_out) tensor."""
    out = None
    for start, end in tiles:
        part = mlp(flat[start:end])  # (rows, H_out)
        if not isinstance(part, torch.Tensor):
            raise TypeError(
                f"tile_mlp: {type(mlp).__name__} returns {type(part).__name__}, not a tensor (a mixture of experts "
                "returning router logits?); only position-wise MLPs can be tiled"
            )
        if out is None:
            out = part.new_empty(flat.shape[0], part.shape[-1])  # (N, H_out)
        out[start:end] = part
    return out


class _TiledFunction(torch.autograd.Function):
    """y = mlp(x) over token tiles; saves nothing itself (the input is the anchor's)."""

    @staticmethod
    def forward(ctx, x, anchor, mlp, tile_rows, *params):  # type: ignore[override]
        ctx.anchor, ctx.mlp, ctx.tile_rows, ctx.params = anchor, mlp, tile_rows, params
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
        (x,) = ctx.anchor.saved_tensors  # inside a checkpoint: this refills it (the recompute)
        flat = x.reshape(-1, x.shape[-1])  # (N, H)
        grad_flat = grad_out.reshape(-1, grad_out.shape[-1])  # (N, H_out)
        trained = [p for p in ctx.params if p.requires_grad]
        dx = torch.empty_like(flat)  # (N, H)
        sums: list[torch.Tensor | None] = [None] * len(trained)
        with torch.enable_grad(), torch.autocast(**ctx.autocast):
            for start, end in _tiles(flat.shape[0], ctx.tile_rows):
                tile = flat[start:end].detach().requires_grad_(True)  # (rows, H)
                # a non-leaf like the forward's tile: autocast casts it at each use (it caches leaves' casts)
                part = ctx.mlp(tile.view_as(tile))  # (rows, H_out)
                grads = torch.autograd.grad(part, [tile, *trained], grad_flat[start:end], allow_unused=True)
                dx[start:end] = grads[0]
                for i, g in enumerate(grads[1:]):
                    if g is not None:
                        sums[i] = g if sums[i] is None else sums[i].add_(g)
        by_param = dict(zip(map(id, trained), sums))
        param_grads = [by_param.get(id(p)) for p in ctx.params]
        return (dx.view_as(x), None, None, None, *param_grads)


class TiledMLP(torch.nn.Module):
    """``original`` (an MLP module) run over tiles of ``tile_tokens`` tokens (see the module docstring);
    same parameters, same ``state_dict`` keys."""

    def __init__(self, original: torch.nn.Module, tile_tokens: int) -> None:
        super().__init__()
        if not isinstance(tile_tokens, int) or tile_tokens < 1:
            raise ValueError(f"TiledMLP tile_tokens must be a positive int, got {tile_tokens!r}")
        object.__setattr__(self, "original", original)  # outside the module tree: keys stay the MLP's
        for name, child in original.named_children():
            self.add_module(name, child)
        for name, param in original.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buffer in original.named_buffers(recurse=False):
            self.register_buffer(name, buffer)
        self.tile_tokens = tile_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            flat = x.reshape(-1, x.shape[-1])  # (N, H)
            out = _run_tiles(self.original, flat, _tiles(flat.shape[0], self.tile_tokens))
            return out.view(*x.shape[:-1], out.shape[-1])
        params = tuple(self.original.parameters())
        anchored = _Anchor.apply(x)
        return _TiledFunction.apply(anchored, anchored.grad_fn, self.original, self.tile_tokens, *params)

    def extra_repr(self) -> str:
        return f"tile_tokens={self.tile_tokens}, original={type(self.original).__name__}"


def _layers_with_mlp(model: torch.nn.Module) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [
        m
        for m in model.modules()
        if isinstance(m, GradientCheckpointingLayer) and isinstance(getattr(m, "mlp", None), torch.nn.Module)
    ]


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
    if tile_tokens is None:
        tile_tokens = getattr(getattr(model, "config", None), "hidden_size", None)
        if not tile_tokens:
            raise ValueError("tile_mlp: the model's config has no hidden_size; give tile_tokens")
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


def tiled_mlp_report(model: torch.nn.Module) -> dict[str, Any]:
    """Tiled MLPs of ``model`` and their tile size (for reports)."""
    tiled = [layer.mlp for layer in _layers_with_mlp(model) if isinstance(layer.mlp, TiledMLP)]
    return {"tiled_mlps": len(tiled), "tiled_mlp_tokens": tiled[0].tile_tokens if tiled else None}
