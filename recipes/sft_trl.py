"""Fine-tune with TRL's SFTTrainer and DistCA: the same run as recipes/finetune_long_docs.py, same flags.

    torchrun --nproc-per-node 2 recipes/sft_trl.py --doc-lengths lengths.json --tokens-per-rank 4096
    accelerate launch --config_file accelerate_configs/ddp_1node.yaml recipes/sft_trl.py --model ... --bf16

Needs ``pip install -e .[trl]``. The trainer is ``hf_distca.sft.DistCASFTTrainer``: TRL's ``SFTTrainer``
with the DistCATrainer overrides in front (``DistCATrainerMixin``), and every DistCA setting in the one
``DistCACallback``. Same seed and flags, same global batches and the same per-step losses as
finetune_long_docs.py (tested on 2 CPU processes).

How DistCA's data path wins over SFTTrainer's own, through public SFTConfig options only:

- ``dataset_kwargs={"skip_prepare_dataset": True}``: SFTTrainer neither tokenizes, truncates (its
  ``max_length`` defaults to 1024) nor packs the dataset; the callback lays whole tokenized documents
  out over the ranks (documents longer than one rank's share are cut over ranks and trained whole).
- ``packing=False, padding_free=False``: SFTTrainer's collator and packing stay unused; the callback's
  loader yields every training micro-batch (``get_train_dataloader``).
- ``completion_only_loss=False, assistant_only_loss=False``: every token of a document is a target,
  as in the Trainer recipe (DistCA's batches carry no completion or assistant masks).
- The loss: ``SFTTrainer.compute_loss`` calls the model with ``fused_lm_head=True``; TRL's fused LM
  head scores the batch's pre-shifted ``shift_labels`` as given (no second shift, no logits
  materialized: what ``--liger`` adds to the Trainer recipe, so ``--liger`` is refused here) and
  divides the summed negative log-likelihood by ``num_items_in_batch``, which the Trainer counts from
  ``shift_labels`` over all ranks: the Trainer recipe's token-weighted loss.
- SFTConfig defaults ``gradient_checkpointing`` and ``bf16`` to True; the recipe sets both from its
  flags (``--gradient-checkpointing``, ``--bf16``), like the Trainer recipe.
"""

from __future__ import annotations

import os
import sys

from finetune_long_docs import (
    LENGTHS_VOCAB,
    build_parser,
    end_process_group,
    finish,
    prepare,
    training_kwargs,
)


def token_id_tokenizer(vocab_size: int):
    """A tokenizer for token-id documents (``--doc-lengths``): SFTTrainer needs one for its pad and EOS
    ids; the documents are already token ids, so it never tokenizes anything. Token ``str(i)`` is id i;
    pad is id 0 (the padding id of the generated documents)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {str(i): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="0"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="0", eos_token=str(vocab_size - 1))


def main(argv=None) -> dict:
    import datasets
    from trl import SFTConfig

    from hf_distca.sft import DistCASFTTrainer

    args = build_parser(__doc__).parse_args(argv)
    if args.liger:
        raise ValueError(
            "--liger: SFTTrainer computes the loss with TRL's own fused LM head (no logits materialized); "
            "leave out --liger"
        )
    sft_args = SFTConfig(
        **training_kwargs(args),
        packing=False,
        padding_free=False,
        dataset_kwargs={"skip_prepare_dataset": True},
        completion_only_loss=False,
        assistant_only_loss=False,
    )
    tokenizer, documents, model, callback = prepare(args, sft_args)
    if not isinstance(documents, datasets.Dataset):  # SFTTrainer takes datasets only
        documents = datasets.Dataset.from_list(documents)
    trainer = DistCASFTTrainer(
        model=model,
        args=sft_args,
        train_dataset=documents,
        processing_class=tokenizer if tokenizer is not None else token_id_tokenizer(LENGTHS_VOCAB),
        callbacks=[callback],
    )
    return finish(args, trainer, callback, tokenizer)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # SFTTrainer pings the Hub otherwise
    summary = main()
    end_process_group()
    sys.exit(0 if summary is not None else 1)
