"""The per-rank DistCA data loader: global token-budget batches, rebatched over the attention servers.

Every rank runs the same deterministic sampler over the same document lengths, so all ranks agree on
each global micro-batch without communication; each rank then keeps its own share of the layout.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, IterableDataset

from hf_distca.data.rebatch import layout_micro_batch
from hf_distca.data.sampler import plan_global_batches
from hf_distca.planning.cost import causal_pairs


@dataclass(frozen=True)
class DistCALayout:
    """What the ``distca`` attention needs per micro-batch: this rank's pieces and every rank's.

    A plain (non-tensor) object, so Trainer/Accelerate pass it through to the model untouched."""

    pieces: tuple[tuple[int, int, int], ...]
    all_pieces: tuple[tuple[tuple[int, int, int], ...], ...]


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
    """Iterates this rank's micro-batches (dicts ready for ``model(**batch)``) for one epoch."""

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
        self.epoch = 0
        self._steps = None
        self._layout_pairs: deque[list[int]] = deque()

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = epoch
            self._steps = None

    @property
    def steps(self) -> list[list[list[int]]]:
        """Optimizer steps -> micro-batches -> document indices (identical on every rank)."""
        if self._steps is None:
            result = plan_global_batches(
                self.documents.lengths,
                tokens_per_step=self.tokens_per_rank * self.world_size * self.grad_accum,
                micro_batches=self.grad_accum,
                seed=self.seed,
                epoch=self.epoch,
            )
            steps = result.steps
            if self.max_steps is not None:
                steps = steps[: self.max_steps]
            self._steps = steps
        return self._steps

    def __len__(self) -> int:
        return len(self.steps) * self.grad_accum

    def __iter__(self) -> Iterator[dict]:
        budget = self.tokens_per_rank * self.world_size  # the sampler reports longer documents as truncated
        for step in self.steps:
            for doc_indices in step:
                yield self.micro_batch([self.documents[i][:budget] for i in doc_indices])

    def pop_layout_pairs(self, micro_batches: int) -> list[int]:
        """Per rank, causal (query, key) pairs of attention restricted to each rank's own pieces, summed
        over the next ``micro_batches`` yielded micro-batches (the baseline's attention load)."""
        total = [0] * self.world_size
        for _ in range(min(micro_batches, len(self._layout_pairs))):
            for r, n in enumerate(self._layout_pairs.popleft()):
                total[r] += n
        return total

    def micro_batch(self, docs: Sequence[Sequence[int]]) -> dict:
        """This rank's share of one global micro-batch of documents."""
        batches = layout_micro_batch(
            docs,
            world_size=self.world_size,
            tokens_per_rank=self.tokens_per_rank,
            pad_token_id=self.pad_token_id,
        )
        mine = batches[self.rank]
        self._layout_pairs.append([sum(causal_pairs(0, int(p[2])) for p in b.pieces) for b in batches])
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
            cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
            batch.update(
                cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths)
            )
        return batch


class DistCADataLoader(DataLoader):
    """A DataLoader over :class:`DistCABatches` (no collation: items are whole micro-batches)."""

    def __init__(self, batches: DistCABatches):
        super().__init__(batches, batch_size=None, num_workers=0)
        self.batches = batches

    def set_epoch(self, epoch: int) -> None:
        self.batches.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.batches)


def count_targets(batch: dict) -> int:
    """Training targets (labels that are not -100) in a micro-batch dict."""
    return int(torch.as_tensor(batch["shift_labels"]).ne(-100).sum())
