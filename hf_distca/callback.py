"""DistCACallback: every DistCA setting of a Trainer run.

It owns the data path (global token-budget batches rebatched over the ranks), the attention-server
group (the data-parallel ranks of Accelerate's device mesh, see
:func:`hf_distca.validation.attention_server_group`), pre-flight checks, the engine's start (its
probes, at ``on_train_begin``) and the run's per-step records (:mod:`hf_distca.step_records`:
``metrics.jsonl`` and a PNG of per-rank attention load). Callbacks cannot change the Trainer's training dataloader, so it works
together with :class:`hf_distca.DistCATrainer`, which hands it the Trainer's documented extension
points (``get_train_dataloader``, ``training_step``, ``log``); see :mod:`hf_distca.trainer`.
"""

from __future__ import annotations

import functools
import hashlib

import torch
from transformers import TrainerCallback

from hf_distca import metrics
from hf_distca.attention import enable_distca
from hf_distca.checkpointing import switch_trainer_checkpointing
from hf_distca.comm import all_gather_rows
from hf_distca.config import DistCAConfig
from hf_distca.data.loader import DistCABatches, DistCADataLoader, TokenDocuments
from hf_distca.data.rebatch import LayoutFn, layout_balanced
from hf_distca.engine import engine_state
from hf_distca.offload_timing import weigh_over_ranks
from hf_distca.offloading import (
    OffloadOptions,
    check_offload_applies,
    offload_activations,
    resolve_over_ranks,
)
from hf_distca.step_records import StepRecords
from hf_distca.validation import (
    attention_server_group,
    check_backend_runs,
    check_config_applies,
    check_launch,
    check_model_supported,
    check_parallelism,
)

NEEDS_DISTCA_TRAINER = (
    "DistCACallback needs hf_distca.DistCATrainer (a transformers Trainer subclass that feeds it DistCA's "
    "batches): replace Trainer(...) with hf_distca.DistCATrainer(..., callbacks=[DistCACallback(...)]) "
    "(TRL's SFTTrainer: hf_distca.sft.DistCASFTTrainer), "
    "or add the callback to a DistCATrainer with trainer.add_callback(...). For plain Accelerate loops use "
    "hf_distca.data.DistCABatches and hf_distca.enable_distca instead."
)


class DistCACallback(TrainerCallback):
    """Balance core attention across data-parallel ranks during ``DistCATrainer.train()``.

    Give it to :class:`hf_distca.DistCATrainer` (``callbacks=[DistCACallback(...)]`` or
    ``trainer.add_callback``); a plain ``transformers.Trainer`` raises a RuntimeError saying so, at
    construction (or, for ``add_callback``, when ``train()`` begins), before any step runs.

    Writes one record per optimizer step to ``metrics_file`` (JSON lines, rank 0), whatever
    ``logging_steps`` is, and adds the same figures to the Trainer's logs on logging steps (see
    :meth:`log_figures`), so ``report_to`` integrations receive them. On ``resume_from_checkpoint``
    the file keeps the records up to the checkpoint's step and continues from there.

    Args:
        tokens_per_rank: the most tokens a rank holds per micro-batch (the global micro-batch's budget
            is ``tokens_per_rank x world_size`` tokens; each is laid out at the fewest tokens per rank
            that hold it unless ``config.pad_to_budget``; documents longer than one rank's share are cut
            into pieces over several ranks and still trained whole).
        config: engine configuration (tolerance, shard size, kernel backend).
        seed: seed of the document order (default: ``TrainingArguments.seed``).
        metrics_file: JSON-lines file (relative to ``output_dir``) with one record per optimizer step.
        plot_file: PNG (relative to ``output_dir``) of per-rank attention load before/after, or None.
        disaggregate: False keeps the same data path but attention stays local to each rank (the
            baseline for comparisons; documents cut over ranks lose cross-rank context).
        column: the dataset column holding each document's token ids.
        pad_token_id: id of padding tokens (default: the model config's, else 0).
        recompute_attention: with activation checkpointing on, recompute core attention in backward as
            plain checkpointing does (for comparison). Default False: rematerialization-aware
            checkpointing keeps each layer's attention output and log-sum-exp instead
            (:mod:`hf_distca.checkpointing`).
        layout: places each micro-batch's documents on the ranks (default: the cost-balanced
            ``hf_distca.data.layout_balanced``, cutting a document inside one node where
            ``config.ranks_per_node`` names the nodes); benchmarks pass the baselines of
            :mod:`hf_distca.data.baselines`.
        offload: what activation checkpointing keeps, off the device (:class:`hf_distca.offloading.OffloadOptions`:
            layer inputs in host memory, kept attention outputs per layer on the device, in host memory or
            dropped; ``kept_attention="auto"`` is chosen before the first step from the least free memory over
            the ranks, and after the first step a layer in host memory drops its outputs where their copies
            were measured to cost more than its attention, :mod:`hf_distca.offload_timing`). Needs
            activation checkpointing; the choice is in :attr:`memory_report`.
        tiled_mlp: run each decoder layer's MLP over tiles of this many tokens (0: the model's hidden size;
            :func:`hf_distca.tiled_mlp.tile_mlp`), keeping only its input for backward. None: off.
        tiled_norms: run the decoder layers' norms and the final norm over tiles of this many tokens (0: the
            hidden size; :func:`hf_distca.tiled_mlp.tile_norms`): only their input is kept for backward, their
            float32 temporaries exist one tile at a time. None: off.
    """

    def __init__(
        self,
        tokens_per_rank: int,
        *,
        config: DistCAConfig | None = None,
        seed: int | None = None,
        metrics_file: str | None = "metrics.jsonl",
        plot_file: str | None = "attention_load.png",
        disaggregate: bool = True,
        column: str = "input_ids",
        pad_token_id: int | None = None,
        recompute_attention: bool = False,
        layout: LayoutFn | None = None,
        offload: OffloadOptions | None = None,
        tiled_mlp: int | None = None,
        tiled_norms: int | None = None,
    ):
        self.config = config or DistCAConfig()
        if not isinstance(tokens_per_rank, int) or tokens_per_rank < self.config.shard_tokens:
            raise ValueError(
                f"tokens_per_rank={tokens_per_rank!r} is smaller than one {self.config.shard_tokens}-token shard; "
                f"use at least {self.config.shard_tokens} (typical: 8192-65536)"
            )
        self.tokens_per_rank = tokens_per_rank
        self.seed = seed
        self.metrics_file = metrics_file
        self.plot_file = plot_file
        self.disaggregate = disaggregate
        self.column = column
        self.pad_token_id = pad_token_id
        self.recompute_attention = recompute_attention
        self.layout = layout
        for name, value in (("tiled_mlp", tiled_mlp), ("tiled_norms", tiled_norms)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(
                    f"{name}={value!r} (--{name.replace('_', '-')}): give tokens per tile (0: the hidden size) or None"
                )
        self.offload, self.tiled_mlp, self.tiled_norms = offload, tiled_mlp, tiled_norms
        self._offload = None
        self._offload_weighed = False  # kept_attention="auto" looked again after its first step
        self.batches: DistCABatches | None = None
        self._trainer = None
        self._group = None
        self._records = StepRecords(metrics_file, plot_file, balanced=disaggregate)

    # ------------------------------------------------------------------ DistCATrainer's side
    def attach(self, trainer, *, args=None, model=None) -> None:
        """Called by DistCATrainer before anything else: the trainer this callback serves. With ``args``
        and ``model`` (a trainer already constructed: ``add_callback``), the pre-flight checks and the
        data path run now; otherwise at the trainer's ``on_init_end``."""
        if self._trainer is not None and self._trainer is not trainer:
            raise ValueError("this DistCACallback already belongs to another trainer; create one per trainer")
        self._trainer = trainer
        if args is not None:
            self._prepare(args, model)

    def _prepare(self, args, model) -> None:
        """Pre-flight checks and the data path; at construction (or add_callback) of the trainer."""
        trainer = self._trainer
        world = check_launch(args)
        accelerator = getattr(trainer, "accelerator", None)
        parallelism = getattr(accelerator, "parallelism_config", None)
        check_parallelism(parallelism, model_tp_size=getattr(model, "tp_size", None))
        self._group, group_rank, group_size = attention_server_group(
            getattr(accelerator, "torch_device_mesh", None), parallelism
        )
        if (group_rank, group_size) != (args.process_index, world):
            raise RuntimeError(
                f"the attention-server group of Accelerate's mesh is rank {group_rank} of {group_size}, but the "
                f"Trainer's data-parallel rank is {args.process_index} of {world}; DistCA needs them equal"
            )
        check_model_supported(model, disaggregate=self.disaggregate)
        impl = getattr(model.config, "_attn_implementation", None)
        check_config_applies(self.config, attn_implementation=impl, disaggregate=self.disaggregate)
        if impl == "distca":
            check_backend_runs(self.config, args.device, _compute_dtype(args, model))
        user = _checkpointing_kwargs(args)
        check_offload_applies(
            self.offload, attn_implementation=impl, checkpointing=_checkpointing_on(args),
            remat=not self.recompute_attention and not user.get("use_reentrant", False),
        )  # fmt: skip
        tiling = self.tiled_mlp is not None or self.tiled_norms is not None
        if getattr(args, "torch_compile", False) and (tiling or (self.offload and self.offload.active)):
            raise ValueError(
                "offload / tiled_mlp / tiled_norms (--offload-activations, --kept-attention, --tiled-mlp, "
                "--tiled-norms) are not traced by torch.compile (module hooks entering saved-tensor hooks, an "
                "autograd function holding the module): leave out --torch-compile (TrainingArguments(torch_compile="
                "True)) or these options"
            )
        if tiling:
            from transformers.integrations import is_deepspeed_zero3_enabled

            from hf_distca.tiled_mlp import tile_mlp, tile_norms

            if is_deepspeed_zero3_enabled():
                tiles = {"tiled_mlp": self.tiled_mlp, "tiled_norms": self.tiled_norms}
                given = [(n, v) for n, v in tiles.items() if v is not None]
                what = " and ".join(f"{n}={v!r}" for n, v in given)
                flags = ", ".join("--" + n.replace("_", "-") for n, _ in given)
                raise ValueError(
                    f"{what} ({flags}) does not run under DeepSpeed ZeRO-3: its backward runs each tile again and "
                    "returns the parameters' gradients itself, and ZeRO-3 has partitioned those parameters again by "
                    f"then. Leave out {flags} under ZeRO-3 (--offload-activations works there), or tile under DDP "
                    "or FSDP2"
                )
            # before the Trainer wraps the model
            if self.tiled_mlp is not None:
                tile_mlp(model, self.tiled_mlp or None)
            if self.tiled_norms is not None:
                tile_norms(model, self.tiled_norms or None)
        if trainer.train_dataset is None:
            raise ValueError("DistCACallback needs DistCATrainer(train_dataset=...) with tokenized documents")
        documents = TokenDocuments(trainer.train_dataset, column=self.column)
        pad = self.pad_token_id
        if pad is None:
            pad = getattr(getattr(model, "config", None), "pad_token_id", None) or 0
        max_steps = args.max_steps if args.max_steps and args.max_steps > 0 else None
        batches = DistCABatches(
            documents,
            rank=args.process_index,
            world_size=world,
            tokens_per_rank=self.tokens_per_rank,
            grad_accum=args.gradient_accumulation_steps,
            seed=args.seed if self.seed is None else self.seed,
            pad_token_id=int(pad),
            max_steps=max_steps,
            disaggregate=self.disaggregate,
            nano_batches=2 if self.config.layer_ping_pong else 1,
            prefetch_plans=self.config.prefetch_plans,
            pad_to_budget=self.config.pad_to_budget,
            layout=self.layout
            or functools.partial(layout_balanced, ranks_per_node=self.config.ranks_per_node),
        )
        if len(batches) == 0:
            raise ValueError(
                f"the dataset fills no optimizer step of {self.tokens_per_rank} tokens x {world} ranks x "
                f"{args.gradient_accumulation_steps} accumulation; add documents or lower tokens_per_rank"
            )
        self.batches = batches
        if self.disaggregate and self.config.prefetch_plans:
            engine_state().prefetcher.start()  # its start overlaps the model's set-up; train() waits for it

    def train_dataloader(self) -> DistCADataLoader:
        """This rank's DistCA micro-batches, for ``Trainer.get_train_dataloader``."""
        return DistCADataLoader(self.batches)

    def record_loss(self, loss: torch.Tensor) -> None:
        """One micro-batch's loss as ``Trainer.training_step`` returns it (summed over the step)."""
        self._records.add_loss(loss)

    def log_figures(self) -> dict[str, float]:
        """The figures added to the Trainer's logs (see :meth:`hf_distca.step_records.StepRecords.log_figures`)."""
        return self._records.log_figures()

    @property
    def records(self) -> list[dict]:
        """The records of the current ``train()`` call (identical on every rank)."""
        return self._records.records

    @property
    def summary(self) -> dict:
        """Mean imbalances over the steps recorded by the current ``train()`` call (see
        :attr:`hf_distca.step_records.StepRecords.summary`)."""
        return self._records.summary

    # ------------------------------------------------------------------ Trainer events
    def on_init_end(self, args, state, control, model=None, **kwargs):
        if self._trainer is None:
            raise RuntimeError(NEEDS_DISTCA_TRAINER)
        self._prepare(args, model)
        return control

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self._trainer is None or self.batches is None:
            raise RuntimeError(NEEDS_DISTCA_TRAINER)
        _check_same_documents(self.batches.documents.lengths)
        metrics.reset()
        if getattr(getattr(model, "config", None), "_attn_implementation", None) == "distca":
            # also without disaggregation: the attention function runs the config's kernel backend; the
            # engine's probes run here, on every rank, only when the engine will run
            dtype = _compute_dtype(args, model)
            enable_distca(model, group=self._group, config=self.config, dtype=dtype, probe=self.disaggregate)
        if self.disaggregate and self.config.prefetch_plans:
            # no plan of the run falls back to inline for want of the worker
            engine_state().prefetcher.start(wait=True)
        if not self.recompute_attention:
            switch_trainer_checkpointing(model, args)  # after the Trainer enabled checkpointing
        if self.offload is not None and self.offload.active:
            self._start_offload(args, model)
        startup = metrics.snapshot(reset=True)
        self._records.begin(args, state.global_step, getattr(model, "config", None), startup)
        return control

    def _start_offload(self, args, model) -> None:
        while not hasattr(model, "gradient_checkpointing_enable") and hasattr(model, "module"):
            model = model.module  # a DDP/FSDP/DeepSpeed wrapper around the Transformers model
        self._offload = offload_activations(model, self.offload)
        # before the first step, every rank the same choice: "auto" kept attention, and the layers whose
        # input goes to host sized for a whole micro-batch (tokens_per_rank rows, both nano-batches of
        # layer ping-pong together), not for the first call's rows (a short micro-batch, one nano-batch)
        if self.offload.kept_attention == "auto" or self.offload.inputs:
            resolve_over_ranks(
                self._offload, self.tokens_per_rank, _compute_dtype(args, model), args.device, self._group
            )

    @property
    def memory_report(self) -> dict:
        """What the memory options chose and moved: the kept-attention policy per layer, offloaded tensors,
        the host arena's size, the tiled MLPs and norms (empty without them)."""
        out = {} if self._offload is None else self._offload.report()
        tiling = self.tiled_mlp is not None or self.tiled_norms is not None
        if tiling and self._trainer is not None:
            from hf_distca.tiled_mlp import tiled_mlp_report

            out.update(tiled_mlp_report(self._trainer.model))
        return out

    def on_epoch_begin(self, args, state, control, **kwargs):
        # the Trainer's epoch after a resume (it sets no epoch on the loader that skips trained steps)
        self.batches.set_epoch(state.global_step // self.batches.steps_per_epoch)
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        self._records.step_begin()
        if self._offload is not None and not self._offload_weighed:
            # the first step is timed for kept_attention="auto"'s second look (offload_timing), every rank alike
            self._offload_weighed = not self._offload.start_timing(args.device)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self._offload is not None and self._offload.timer is not None:
            weigh_over_ranks(self._offload, args.device, self._group)  # collective, between steps
            self._offload_weighed = True
        tokens = self.tokens_per_rank * max(args.world_size, 1) * args.gradient_accumulation_steps
        self._records.step_end(args, state.global_step, self.batches, tokens)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self._records.finish(args)
        return control


def _compute_dtype(args, model) -> torch.dtype:
    """The dtype attention runs in: the Trainer's mixed precision, else the model's parameters'."""
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return next(model.parameters()).dtype


def _checkpointing_on(args) -> bool:
    """Whether the Trainer's arguments turn activation checkpointing on (5.24 renamed the field)."""
    return bool(
        getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False)
    )


def _checkpointing_kwargs(args) -> dict:
    user = getattr(args, "activation_checkpointing_kwargs", None)
    if user is None:
        user = getattr(args, "gradient_checkpointing_kwargs", None)
    return dict(user or {})


def _check_same_documents(lengths: list[int]) -> None:
    """Every rank must plan from the same documents; compare a digest of their lengths."""
    digest = int.from_bytes(hashlib.sha256(repr(lengths).encode()).digest()[:7], "big")
    seen = [int(row[0]) for row in all_gather_rows([digest])]
    if len(set(seen)) != 1:
        raise RuntimeError(
            "ranks see different training documents (their token lengths differ); every rank must load and "
            "tokenize the same dataset in the same order (same tokenizer, no per-rank shuffling)"
        )
