"""The per-rank DistCA data loader: global token-budget batches, rebatched over the attention servers.

Every rank runs the same deterministic sampler over the same document lengths, so all ranks agree on
each global micro-batch without communication; each rank then keeps its own share of the layout.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader, IterableDataset

from hf_distca.data.nano import NANO_BATCHES, nano_tokens_per_rank, split_documents, whole_tokens_per_rank
from hf_distca.data.rebatch import LayoutFn, layout_balanced, layout_for_rank
from hf_distca.data.sampler import plan_global_batches
from hf_distca.engine.compiled import register_layout
from hf_distca.engine.state import engine_state
from hf_distca.kernels.common import int32_offsets
from hf_distca.planning.window import attended_pairs


@dataclass(frozen=True)
class DistCALayout:
    """What the ``distca`` attention needs per micro-batch: this rank's pieces and every rank's.

    A plain (non-tensor) object, so Trainer/Accelerate pass it through to the model untouched; its
    ``token`` names it to the engine's compiled ops (:mod:`hf_distca.engine.compiled`), so that a model under
    ``torch.compile`` reads only that tensor and never recompiles for a new layout."""

    pieces: tuple[tuple[int, int, int], ...]
    all_pieces: tuple[tuple[tuple[int, int, int], ...], ...]
    token: torch.Tensor = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "token", register_layout(self))


class TokenDocuments:
    """Random access to tokenized documents: a list of token-id lists, or a dataset of rows with an
    ``input_ids`` column (datasets.Dataset, or any indexable of dicts)."""

    def __init__(self, documents, column: str = "input_ids"):
        self.documents = documents
        self.column = column
        if len(documents) == 0:
            raise ValueError("the training dataset is empty; give at least one tokenized document")
        first = documents[0]
        self.is_rows = isinstance(first, dict)
        if self.is_rows and column not in first:
            raise ValueError(
                f"dataset rows have no {column!r} column (columns: {sorted(first)}); tokenize the text into "
                f"{column!r} first (see recipes/finetune_long_docs.py)"
            )
        self._lengths: list[int] | None = None

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, i: int) -> list[int]:
        row = self.documents[i]
        ids = row[self.column] if self.is_rows else row
        return ids.tolist() if hasattr(ids, "tolist") else list(ids)

    @property
    def lengths(self) -> list[int]:
        if self._lengths is None:
            col = None
            if hasattr(self.documents, "column_names") and self.column in self.documents.column_names:
                col = self.documents[self.column]  # datasets.Dataset: one columnar read
            seq = col if col is not None else (self[i] for i in range(len(self)))
            self._lengths = [len(x) for x in seq]
        return self._lengths


class DistCABatches(IterableDataset):
    """Iterates this rank's micro-batches (dicts ready for ``model(**batch)``), one epoch per iteration.

    The optimizer steps form one endless stream: the plan of data epoch 0 (every document once,
    shuffled with ``seed``), then data epoch 1 (``seed + 1``), and so on, back to back. An epoch of
    this loader is a fixed-size chunk of that stream, ``steps_per_epoch`` steps (data epoch 0's step
    count, at most ``max_steps``), and ``set_epoch(k)`` selects chunk ``k``. A fixed epoch size is
    what the Trainer's resume arithmetic assumes (epoch = global_step // steps per epoch, then skip the
    rest), so stream step ``global_step - 1`` is always the step trained at ``global_step``, whether the
    run was resumed or not.
    """

    def __init__(
        self,
        documents: TokenDocuments | Sequence,
        *,
        rank: int,
        world_size: int,
        tokens_per_rank: int,
        grad_accum: int = 1,
        seed: int = 0,
        pad_token_id: int = 0,
        max_steps: int | None = None,
        disaggregate: bool = True,
        layout: LayoutFn | None = None,
        nano_batches: int = 1,
        prefetch_plans: bool = False,
        pad_to_budget: bool = False,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.documents = documents if isinstance(documents, TokenDocuments) else TokenDocuments(documents)
        self.rank = rank
        self.world_size = world_size
        self.tokens_per_rank = tokens_per_rank
        self.grad_accum = grad_accum
        self.seed = seed
        self.pad_token_id = pad_token_id
        self.max_steps = max_steps
        self.disaggregate = disaggregate
        self.layout = layout or layout_balanced
        """Places each micro-batch's documents on the ranks (default: the cost-balanced layout_balanced)."""
        if not isinstance(nano_batches, int) or nano_batches < 1:
            raise ValueError(f"nano_batches must be a positive int, got {nano_batches!r}")
        self.nano_batches = nano_batches
        """Nano-batches per micro-batch for layer-level ping-pong (:mod:`hf_distca.data.nano`; 1: none)."""
        self.pad_to_budget = pad_to_budget
        """False (``DistCAConfig.pad_to_budget``'s default): a micro-batch that runs whole is laid out at the
        fewest tokens per rank that hold it (:func:`hf_distca.data.nano.nano_tokens_per_rank`, as
        nano-batches always are): no padding beyond ``world_size - 1`` tokens, shapes that change from step
        to step. True: at ``tokens_per_rank`` (the same shapes every step, the ranks' room padded)."""
        self.prefetch_plans = prefetch_plans
        """Hand each micro-batch's layouts to the engine's background planner when the micro-batch before
        it is yielded (:meth:`hf_distca.engine.prefetch.Prefetcher.prefetch_plans`; ``DistCAConfig.prefetch_plans``)."""
        self.epoch = 0
        self.current_step: int | None = None
        """Stream index of the step whose micro-batch was yielded last (None before the first)."""
        self._plans: dict[int, list[list[list[int]]]] = {}  # data epoch -> its steps (the last two used)
        self._plan_sizes: list[int] = []  # steps of data epochs 0, 1, ... planned so far
        self._layouts: dict[
            int, list
        ] = {}  # stream step -> per micro-batch yielded, each nano-batch's all_pieces

    def set_epoch(self, epoch: int) -> None:
        """The next iteration yields chunk ``epoch`` of the step stream."""
        self.epoch = epoch

    @property
    def steps_per_epoch(self) -> int:
        steps = len(self._data_epoch(0))
        return steps if self.max_steps is None else min(steps, self.max_steps)

    def step(self, index: int) -> list[list[int]]:
        """Optimizer step ``index`` of the stream: micro-batches -> document indices (same on every rank)."""
        data_epoch = 0
        while True:
            if data_epoch == len(self._plan_sizes):
                self._plan_sizes.append(len(self._data_epoch(data_epoch)))
            if index < self._plan_sizes[data_epoch]:
                return self._data_epoch(data_epoch)[index]
            index -= self._plan_sizes[data_epoch]
            data_epoch += 1

    @property
    def steps(self) -> list[list[list[int]]]:
        """The optimizer steps of the current epoch: steps -> micro-batches -> document indices."""
        first = self.epoch * self.steps_per_epoch
        return [self.step(first + i) for i in range(self.steps_per_epoch)]

    def _data_epoch(self, data_epoch: int) -> list[list[list[int]]]:
        if data_epoch not in self._plans:
            self._plans[data_epoch] = plan_global_batches(
                self.documents.lengths,
                tokens_per_step=self.tokens_per_rank * self.world_size * self.grad_accum,
                micro_batches=self.grad_accum,
                seed=self.seed,
                epoch=data_epoch,
            ).steps
            for old in sorted(self._plans)[:-2]:
                del self._plans[old]
        return self._plans[data_epoch]

    def __len__(self) -> int:
        return self.steps_per_epoch * self.grad_accum

    def __iter__(self) -> Iterator[dict]:
        budget = self.tokens_per_rank * self.world_size  # the sampler reports longer documents as truncated
        first = self.epoch * self.steps_per_epoch
        look_ahead = self.prefetch_plans and self.disaggregate
        prefetcher = engine_state().prefetcher
        if look_ahead:
            prefetcher.start()
        ahead = None  # (step, batch, all_pieces): with look_ahead, built one micro-batch ahead
        for index in range(first, first + self.steps_per_epoch):
            for doc_indices in self.step(index):
                built = (index, *self._micro_batch([self.documents[i][:budget] for i in doc_indices]))
                if not look_ahead:
                    yield self._yielded(*built)
                    continue
                if ahead is not None:
                    for layout in _layouts_of(built[1]):
                        prefetcher.prefetch_plans(layout.all_pieces)
                    yield self._yielded(*ahead)
                ahead = built
        if ahead is not None:
            yield self._yielded(*ahead)

    def _yielded(self, index: int, batch: dict, all_pieces: list) -> dict:
        """``batch`` of stream step ``index``, recorded as the micro-batch yielded last."""
        self.current_step = index
        self._layouts.setdefault(index, []).append(all_pieces)
        for old in sorted(self._layouts)[:-2]:
            del self._layouts[old]
        return batch

    def layout_load(
        self, index: int, layout: LayoutFn | None = None, windows: Sequence[int | None] = (None,)
    ) -> list[int]:
        """Per rank, the causal (query, key) pairs of step ``index`` of the stream with every rank
        computing its own pieces with their full context (queries [doc_start, doc_end) of a piece
        over keys [0, doc_end)), summed over the step's micro-batches: the attention load without
        balancing, exactly the planner's ``load_before``, whatever the attention mode. ``layout``
        prices the same documents placed by another layout (default: this stream's); ``windows``: one
        sliding window per layer (None: full causal), summed over them (default: one full layer)."""
        micro_batches = self.step(index)
        layouts = self._layouts.get(index) if layout is None else None  # what the loader already laid out
        if layouts is None or len(layouts) != len(micro_batches):
            budget = self.tokens_per_rank * self.world_size
            lengths = self.documents.lengths
            layouts = []  # laid out here: each micro-batch whole, as the loader lays it out
            for doc_indices in micro_batches:
                doc_lengths = [min(lengths[i], budget) for i in doc_indices]
                tokens = self.whole_tokens_per_rank(doc_lengths)
                layouts.append(
                    [(layout or self.layout)(doc_lengths, world_size=self.world_size, tokens_per_rank=tokens)]
                )
        total = [0] * self.world_size
        for pieces in (nano for micro in layouts for nano in micro):
            for rank, rank_pieces in enumerate(pieces):
                total[rank] += sum(
                    attended_pairs(p.doc_start, p.doc_start + p.length, w)
                    for w in windows
                    for p in rank_pieces
                )
        return total

    def micro_batch(self, docs: Sequence[Sequence[int]]) -> dict:
        """This rank's share of one global micro-batch of documents. With ``nano_batches`` > 1 (and
        enough documents) its ``distca_nano_batches`` holds one such dict per nano-batch (each laid out
        on its own at its own tokens per rank, :func:`hf_distca.data.nano.nano_tokens_per_rank`) and its ``input_ids`` and ``labels`` are theirs
        concatenated (and ``shift_labels``), for counting only: run it with :func:`hf_distca.forward_nano_batches`."""
        return self._micro_batch(docs)[0]

    def _micro_batch(self, docs: Sequence[Sequence[int]]) -> tuple[dict, list[tuple]]:
        """:meth:`micro_batch` and every rank's pieces of the layout of each of its nano-batches."""
        lengths = [len(d) for d in docs]
        whole = self.whole_tokens_per_rank(lengths)  # checks the budget
        groups = None
        if self.nano_batches > 1 and self.disaggregate:
            groups = split_documents(lengths, self.nano_batches)
        if groups is None:
            batch, all_pieces = self._laid_out(docs, whole)
            return batch, [all_pieces]
        tokens = nano_tokens_per_rank([[lengths[i] for i in g] for g in groups], self.world_size)
        nanos = [self._laid_out([docs[i] for i in g], t) for g, t in zip(groups, tokens, strict=True)]
        labels = torch.cat([b["shift_labels"] for b, _ in nanos], dim=1)  # (1, sum of T_nano), T_nano differ
        batch = {  # what the Trainer counts (tokens seen, targets: shift_labels, already shifted)
            "input_ids": torch.cat([b["input_ids"] for b, _ in nanos], dim=1),
            "labels": labels,
            "shift_labels": labels,
            NANO_BATCHES: tuple(b for b, _ in nanos),
        }
        return batch, [pieces for _, pieces in nanos]

    def whole_tokens_per_rank(self, doc_lengths: Sequence[int]) -> int:
        """:func:`hf_distca.data.nano.whole_tokens_per_rank` under this loader's budget, ``pad_to_budget`` and
        layout; raises when the documents exceed the budget."""
        total = sum(int(n) for n in doc_lengths)
        if total > self.tokens_per_rank * self.world_size:
            raise ValueError(
                f"a micro-batch of {total} tokens exceeds the budget of {self.world_size} ranks x "
                f"{self.tokens_per_rank} tokens; give fewer documents per micro-batch, or a larger tokens_per_rank"
            )
        return whole_tokens_per_rank(
            doc_lengths, self.world_size, self.tokens_per_rank, self.pad_to_budget, self.layout
        )

    def _laid_out(self, docs: Sequence[Sequence[int]], tokens_per_rank: int) -> tuple[dict, tuple]:
        """This rank's model inputs for ``docs`` laid out at ``tokens_per_rank``, and every rank's pieces."""
        mine = layout_for_rank(
            docs,
            rank=self.rank,
            world_size=self.world_size,
            tokens_per_rank=tokens_per_rank,
            pad_token_id=self.pad_token_id,
            layout=self.layout,
        )
        batch = {
            "input_ids": mine.input_ids,  # (1, T)
            "position_ids": mine.position_ids,  # (1, T), true positions inside each document
            "labels": mine.shift_labels,  # (1, T); already shifted: the loss reads shift_labels
            "shift_labels": mine.shift_labels,  # (1, T)
        }
        if self.disaggregate:
            batch["distca_layout"] = DistCALayout(
                pieces=tuple(tuple(int(x) for x in p) for p in mine.pieces),
                all_pieces=tuple(
                    tuple(tuple(int(x) for x in p) for p in pieces) for pieces in mine.all_pieces
                ),
            )
        else:
            # baseline: every local piece is its own sequence (no context from other ranks)
            lengths = [int(p[2]) for p in mine.pieces if int(p[2]) > 0]
            # row offsets past 2**31 - 1 are refused, not wrapped as an int32 cumsum would
            cu = int32_offsets(list(itertools.accumulate(lengths, initial=0)))
            batch.update(
                cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths)
            )
        return batch, mine.all_pieces


def _layouts_of(batch: dict) -> list[DistCALayout]:
    """The layouts the engine will plan for ``batch``: its own, or each nano-batch's (none without
    disaggregation)."""
    parts = batch.get(NANO_BATCHES, (batch,))
    return [part["distca_layout"] for part in parts if "distca_layout" in part]


class DistCADataLoader(DataLoader):
    """A DataLoader over :class:`DistCABatches` (no collation: items are whole micro-batches)."""

    def __init__(self, batches: DistCABatches):
        super().__init__(batches, batch_size=None, num_workers=0)
        self.batches = batches

    def set_epoch(self, epoch: int) -> None:
        self.batches.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.batches)
