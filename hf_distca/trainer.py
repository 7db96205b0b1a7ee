"""DistCATrainer: the transformers Trainer with DistCA's data path, through documented overrides only.

A callback cannot replace the Trainer's training dataloader, see each micro-batch's loss, or add
figures to the logs before the ``report_to`` integrations (callbacks that run before user callbacks)
receive them. :class:`DistCATrainerMixin` overrides the methods Transformers documents for that
("Subclass and override"): ``get_train_dataloader``, ``training_step``, ``compute_loss`` (layer-level
ping-pong nano-batches) and ``log``, plus
``add_callback``; every DistCA setting stays in the one :class:`~hf_distca.callback.DistCACallback`
the user adds. The two talk through the callback's public methods only: ``attach``,
``train_dataloader``, ``record_loss`` and ``log_figures``. The mixin goes in front of any ``transformers.Trainer`` subclass:
``DistCATrainer(DistCATrainerMixin, Trainer)`` here, ``DistCASFTTrainer(DistCATrainerMixin, SFTTrainer)``
in :mod:`hf_distca.sft`.
"""

from __future__ import annotations

import inspect

from transformers import Trainer

from hf_distca.callback import DistCACallback
from hf_distca.data.loader import DistCADataLoader
from hf_distca.nano_batches import combined_loss, forward_nano_batches, nano_batches_of
from hf_distca.validation import check_parallelism


def _needs_callback(trainer) -> str:
    name = type(trainer).__name__
    return (
        f"{name} needs exactly one DistCACallback: {name}(..., callbacks=[hf_distca.DistCACallback("
        "tokens_per_rank=...)]) or trainer.add_callback(hf_distca.DistCACallback(...)) before train()"
    )


class DistCATrainerMixin:
    """DistCA's overrides of ``transformers.Trainer``; put it first among the bases of a Trainer
    subclass (``class T(DistCATrainerMixin, SomeTrainer)``). It takes the constructor arguments of
    that trainer unchanged and adds none: the ``DistCACallback`` among ``callbacks`` holds every
    DistCA setting (see :class:`DistCATrainer`)."""

    def __init__(self, *args, **kwargs):
        # the next class's constructor names where `callbacks` sits among the positional arguments
        bound = inspect.signature(super().__init__).bind_partial(*args, **kwargs)
        callbacks = list(bound.arguments.get("callbacks") or [])
        _refuse_callback_classes(callbacks)
        distca = [cb for cb in callbacks if isinstance(cb, DistCACallback)]
        if len(distca) > 1:
            raise ValueError(f"got {len(distca)} DistCACallbacks; " + _needs_callback(self))
        if distca:  # before the Accelerator validates a mesh that DistCA would refuse anyway
            check_parallelism(getattr(bound.arguments.get("args"), "parallelism_config", None))
        for cb in distca:  # before Trainer.__init__, whose on_init_end runs the callback's checks
            cb.attach(self)
        super().__init__(*args, **kwargs)

    @property
    def distca_callback(self) -> DistCACallback:
        """The DistCACallback of this trainer (ValueError when there is none)."""
        found = self._distca_callback()
        if found is None:
            raise ValueError(_needs_callback(self))
        return found

    def _distca_callback(self) -> DistCACallback | None:
        found = [cb for cb in self.callback_handler.callbacks if isinstance(cb, DistCACallback)]
        if len(found) > 1:
            raise ValueError(f"got {len(found)} DistCACallbacks; " + _needs_callback(self))
        return found[0] if found else None

    def add_callback(self, callback) -> None:
        """``Trainer.add_callback``; a DistCACallback is checked and prepared at once."""
        _refuse_callback_classes([callback])
        if isinstance(callback, DistCACallback):
            current = self._distca_callback()
            if current is not None and current is not callback:
                raise ValueError("this trainer already has a DistCACallback; " + _needs_callback(self))
            callback.attach(self, args=self.args, model=self.model)
        super().add_callback(callback)

    def get_train_dataloader(self) -> DistCADataLoader:
        """This rank's DistCA micro-batches (global token-budget batches laid out over the ranks)."""
        return self.distca_callback.train_dataloader()

    def training_step(self, *args, **kwargs):
        """``Trainer.training_step``; its loss also goes to the callback's per-step record."""
        loss = super().training_step(*args, **kwargs)
        self.distca_callback.record_loss(loss)
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """``Trainer.compute_loss``; a micro-batch of layer-level ping-pong nano-batches
        (``DistCAConfig.layer_ping_pong``) runs as their interleaved forwards, losses combined exactly."""
        nanos = nano_batches_of(inputs)
        if nanos is None:
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        if return_outputs:
            raise ValueError(
                "compute_loss(return_outputs=True) got a micro-batch of layer ping-pong nano-batches, whose "
                "outputs are per nano-batch; evaluate without DistCAConfig(layer_ping_pong=True)"
            )
        parent = super().compute_loss
        losses = forward_nano_batches(
            model, lambda nano: parent(model, nano, num_items_in_batch=num_items_in_batch), inputs
        )
        return combined_loss(losses, nanos, summed=num_items_in_batch is not None)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """``Trainer.log``; training logs (those with a ``loss``) also carry the DistCA figures."""
        callback = self._distca_callback()
        if callback is not None and "loss" in logs:
            logs.update(callback.log_figures())
        super().log(logs, *args, **kwargs)


class DistCATrainer(DistCATrainerMixin, Trainer):
    """A ``transformers.Trainer`` that trains with DistCA; takes every Trainer argument unchanged.

    Usage: ``DistCATrainer(model=..., args=..., train_dataset=tokenized_documents,
    callbacks=[hf_distca.DistCACallback(tokens_per_rank=65536)]).train()``. The callback holds every
    DistCA setting and may also be added later with ``trainer.add_callback``; ``train()`` without one
    raises. ``train_dataset`` holds whole tokenized documents (an ``input_ids`` column); the callback
    builds the token-budget batches from it, so ``per_device_train_batch_size``, ``data_collator`` and
    the dataloader options do not apply to training.
    """


def _refuse_callback_classes(callbacks) -> None:
    for cb in callbacks:
        if isinstance(cb, type) and issubclass(cb, DistCACallback):
            raise ValueError("pass a DistCACallback instance, e.g. DistCACallback(tokens_per_rank=65536)")
