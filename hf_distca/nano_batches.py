"""Running a micro-batch of layer-level ping-pong nano-batches through a model (Trainer or plain loop).

With ``DistCAConfig(layer_ping_pong=True)`` the data path (:class:`hf_distca.data.DistCABatches`) splits
every micro-batch's documents into two nano-batches of about equal cost (:mod:`hf_distca.data.nano`), each a
micro-batch of its own under ``batch["distca_nano_batches"]``. :func:`forward_nano_batches` runs the
model once per nano-batch, interleaved (:mod:`hf_distca.engine.interleave`): while one nano-batch's
attention exchanges fly, the other runs its projections, MLP and kernels. The losses combine into the
micro-batch's loss exactly (:func:`combined_loss`). ``DistCATrainer`` does this in ``compute_loss``;
a plain Accelerate loop calls :func:`nano_batch_loss`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hf_distca.data.nano import NANO_BATCHES
from hf_distca.data.rebatch import IGNORE_INDEX
from hf_distca.engine.interleave import run_interleaved

__all__ = ["NANO_BATCHES", "combined_loss", "forward_nano_batches", "nano_batch_loss", "nano_batches_of"]


def nano_batches_of(batch: dict) -> Sequence[dict] | None:
    """The nano-batches of ``batch`` (None: a micro-batch that runs whole)."""
    return batch.get(NANO_BATCHES)


def _fsdp_units(model: torch.nn.Module) -> dict[torch.nn.Module, Any]:
    """Every submodule of ``model`` -> the innermost FSDP2 unit (``fully_shard``) that holds it."""
    from torch.distributed.fsdp import FSDPModule

    units: dict[torch.nn.Module, Any] = {}
    for unit in model.modules():  # pre-order: an inner unit overwrites its outer one
        if isinstance(unit, FSDPModule):
            for sub in unit.modules():
                units[sub] = unit
    return units


def forward_nano_batches(model: torch.nn.Module, fn: Callable[[dict], Any], batch: dict) -> list[Any]:
    """``[fn(nano) for nano in the nano-batches of batch]``, the calls interleaved (``[fn(batch)]`` for a
    micro-batch that runs whole); ``fn`` runs ``model``. Every rank must call it with the same structure
    of nano-batches.

    FSDP2 (``fully_shard``) reshards a unit's parameters when a forward leaves it; the other nano-batch,
    still inside that unit, then gets them gathered again (``FSDPModule.unshard``) when its attention call
    returns: one more all-gather per unit and nano-batch in forward, none with ``fully_shard(...,
    reshard_after_forward=False)``. DeepSpeed ZeRO-3 gathers and releases each leaf module's parameters
    around that module's own forward, which never contains a switch."""
    nanos = nano_batches_of(batch)
    if nanos is None:
        return [fn(batch)]
    units = _fsdp_units(model)

    def regather(module: torch.nn.Module) -> None:
        unit = units.get(module)
        if unit is not None:
            unit.unshard()  # a no-op while still gathered

    return run_interleaved([lambda nano=nano: fn(dict(nano)) for nano in nanos], regather if units else None)


def _targets(batch: dict) -> torch.Tensor:
    labels = batch.get("shift_labels", batch.get("labels"))
    if labels is None:
        raise ValueError("a nano-batch without labels: its share of the loss is unknown")
    return (labels != IGNORE_INDEX).sum()


def combined_loss(losses: Sequence[torch.Tensor], nanos: Sequence[dict], summed: bool) -> torch.Tensor:
    """The micro-batch's loss from its nano-batches' losses: their sum when each was already divided by the
    whole batch's target count (``summed``: Transformers' ``num_items_in_batch``), else their mean weighted
    by each one's targets (each loss a mean over its own targets)."""
    if summed:
        return torch.stack(list(losses)).sum()
    counts = torch.stack([_targets(n).to(losses[0].device, torch.float32) for n in nanos])
    return (torch.stack(list(losses)).float() * counts).sum() / counts.sum().clamp(min=1)


def nano_batch_loss(model: torch.nn.Module, batch: dict, num_items_in_batch: Any = None) -> torch.Tensor:
    """The loss of one micro-batch for a plain training loop: ``model(**batch).loss``, or with nano-batches
    their interleaved forwards' losses combined. ``num_items_in_batch``: passed to the model (the targets
    of the whole optimizer step) so that each loss is a sum over that count."""
    extra = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
    losses = forward_nano_batches(model, lambda b: model(**b, **extra).loss, batch)
    nanos = nano_batches_of(batch)
    return losses[0] if nanos is None else combined_loss(losses, nanos, num_items_in_batch is not None)
