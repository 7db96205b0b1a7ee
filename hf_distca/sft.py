"""DistCASFTTrainer: TRL's ``SFTTrainer`` with DistCA's data path (needs ``pip install hf_distca[trl]``).

The same :class:`~hf_distca.trainer.DistCATrainerMixin` as :class:`hf_distca.DistCATrainer`, in front
of ``trl.SFTTrainer``: the :class:`~hf_distca.DistCACallback` builds the batches (global token-budget
batches laid out over the ranks, with pre-shifted ``shift_labels``), the Trainer counts
``num_items_in_batch`` from those ``shift_labels`` (over all ranks with
``average_tokens_across_devices``), and SFTTrainer's fused LM head scores ``shift_labels`` as given,
without shifting again and without materializing the logits. The loss is then the Trainer's:
``sum of -log p(target) / num_items_in_batch``.

SFTTrainer prepares data on its own (tokenization, truncation to ``max_length``, packing, label
masks) and chooses its loss from the config; every option that would change DistCA's batches or
their loss is refused with an error naming the setting (see :data:`REQUIRED_SETTINGS`), never
changed silently.
"""

from __future__ import annotations

try:
    from trl import SFTConfig, SFTTrainer
except ImportError as err:  # an optional dependency
    raise ImportError("hf_distca.sft needs TRL >= 1.16: pip install -e .[trl]") from err

from hf_distca.trainer import DistCATrainerMixin

REQUIRED_SETTINGS = (
    "SFTConfig(packing=False, padding_free=False, dataset_kwargs={'skip_prepare_dataset': True}, "
    "completion_only_loss=False, assistant_only_loss=False, label_smoothing_factor=0.0) and no "
    "compute_loss_func"
)
"""What DistCASFTTrainer needs: DistCA's callback builds every training batch from whole tokenized
documents, so SFTTrainer must neither prepare (truncate, pack) the dataset nor mask labels, and the
loss must score the pre-shifted ``shift_labels`` (a ``compute_loss_func`` or label smoothing would
shift the labels a second time)."""


class DistCASFTTrainer(DistCATrainerMixin, SFTTrainer):
    """``trl.SFTTrainer`` that trains with DistCA; takes every SFTTrainer argument unchanged.

    Usage::

        trainer = DistCASFTTrainer(
            model=model,  # attn_implementation="distca"
            args=SFTConfig(..., packing=False, padding_free=False,
                           dataset_kwargs={"skip_prepare_dataset": True}),
            train_dataset=datasets.Dataset.from_list(tokenized_documents),  # an "input_ids" column
            processing_class=tokenizer,
            callbacks=[hf_distca.DistCACallback(tokens_per_rank=65536)],
        )

    Raises ValueError at construction when the config would change DistCA's batches or their loss
    (:data:`REQUIRED_SETTINGS`).
    """

    def __init__(self, model, args: SFTConfig | None = None, *rest, **kwargs):
        _check_sft_config(args, kwargs.get("compute_loss_func"))
        super().__init__(model, args, *rest, **kwargs)


def _check_sft_config(args, compute_loss_func) -> None:
    if not isinstance(args, SFTConfig):
        raise ValueError(
            f"DistCASFTTrainer needs args=SFTConfig(...), got {type(args).__name__}: {REQUIRED_SETTINGS}"
        )
    wrong = []
    if args.packing:
        wrong.append(f"packing={args.packing!r}")
    if args.padding_free:
        wrong.append(f"padding_free={args.padding_free!r}")
    if not (args.dataset_kwargs or {}).get("skip_prepare_dataset", False):
        wrong.append(f"dataset_kwargs={args.dataset_kwargs!r}")
    if args.completion_only_loss:
        wrong.append(f"completion_only_loss={args.completion_only_loss!r}")
    if args.assistant_only_loss:
        wrong.append(f"assistant_only_loss={args.assistant_only_loss!r}")
    if args.label_smoothing_factor:
        wrong.append(f"label_smoothing_factor={args.label_smoothing_factor!r}")
    if compute_loss_func is not None:
        wrong.append("compute_loss_func=<given>")
    if wrong:
        raise ValueError(
            f"DistCASFTTrainer: {', '.join(wrong)} would change DistCA's batches or their loss; use "
            f"{REQUIRED_SETTINGS} (DistCACallback builds every batch from whole tokenized documents)"
        )
