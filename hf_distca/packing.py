"""Document boundaries of the batches Transformers hands to the attention function (pure helpers).

A packed batch is one row ``(1, S)`` holding several documents back to back. Its boundaries come,
in order of preference, from the flash-attention kwargs of
``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` (``cu_seq_lens_q/k``), from
``position_ids`` (a document starts where the position is 0 or is not the previous one plus 1), or
else the whole row is one document. A padded batch ``(B, S)`` with a 2-D padding mask is unpadded:
the valid tokens of each row form one causal document, whatever side the padding is on (this is
what SDPA computes with that mask).

Document lengths are returned as Python lists (one host synchronisation): the engine plans on the
host anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "Unpadded",
    "cu_seqlens_from_lengths",
    "lengths_from_cu_seqlens",
    "lengths_from_position_ids",
    "packed_document_lengths",
    "pieces_from_lengths",
    "scatter_rows",
    "unpad",
]


def lengths_from_cu_seqlens(
    cu_seq_lens_q: torch.Tensor | Sequence[int],
    cu_seq_lens_k: torch.Tensor | Sequence[int] | None = None,
    total: int | None = None,
) -> list[int]:
    """Document lengths from cumulative offsets ``[0, l0, l0 + l1, ...]``.

    ``cu_seq_lens_k`` must equal ``cu_seq_lens_q`` (self-attention); ``total``, when given, is the
    number of tokens the offsets must cover. Zero-length documents are kept (callers skip them).
    """
    cu_q = _as_list(cu_seq_lens_q, "cu_seq_lens_q")
    if cu_seq_lens_k is not None:
        cu_k = _as_list(cu_seq_lens_k, "cu_seq_lens_k")
        if cu_k != cu_q:
            raise ValueError(
                "cu_seq_lens_q and cu_seq_lens_k differ; distca computes causal self-attention over packed "
                "documents and needs identical query and key offsets (cross-attention is not supported)"
            )
    if len(cu_q) < 2 or cu_q[0] != 0:
        raise ValueError(f"cu_seq_lens must start at 0 and hold at least 2 entries, got {cu_q[:8]}...")
    lengths = [b - a for a, b in zip(cu_q[:-1], cu_q[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError("cu_seq_lens must be non-decreasing")
    if total is not None and cu_q[-1] != total:
        raise ValueError(
            f"cu_seq_lens covers {cu_q[-1]} tokens but the packed row holds {total}; build the batch with "
            "transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True) without extra padding"
        )
    return lengths


def lengths_from_position_ids(position_ids: torch.Tensor) -> list[int]:
    """Document lengths of one packed row from its position ids, shaped (S,) or (1, S).

    A new document starts at token 0 and wherever the position is 0 or is not the previous
    position plus 1 (the rule of Transformers' packed-sequence detection).
    """
    pos = position_ids.reshape(-1)  # (S,)
    if pos.numel() == 0:
        return []
    starts = torch.ones_like(pos, dtype=torch.bool)  # (S,)
    starts[1:] = (pos[1:] == 0) | (pos[1:] != pos[:-1] + 1)
    start_idx = starts.nonzero().flatten().tolist()
    bounds = [*start_idx, pos.numel()]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def packed_document_lengths(
    batch_size: int,
    seq_len: int,
    *,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> list[int]:
    """Lengths of the documents of an unpadded ``(batch_size, seq_len)`` batch, row after row.

    cu_seq_lens (only with batch size 1) win over position ids; position ids may be (1, S) (broadcast
    to every row) or (B, S); without either, every row is one document. A document never spans two rows.
    """
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        if batch_size != 1:
            raise ValueError(
                "packed batches must have batch size 1; use "
                "transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True) "
                f"(got batch size {batch_size} with cu_seq_lens_q/cu_seq_lens_k kwargs)"
            )
        cu_q = cu_seq_lens_q if cu_seq_lens_q is not None else cu_seq_lens_k
        return lengths_from_cu_seqlens(cu_q, cu_seq_lens_k, total=seq_len)
    if position_ids is None:
        return [seq_len] * batch_size
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)  # (1, S)
    if (
        position_ids.dim() != 2
        or position_ids.shape[-1] != seq_len
        or position_ids.shape[0] not in (1, batch_size)
    ):
        raise ValueError(
            f"position_ids shaped {tuple(position_ids.shape)} do not match the batch ({batch_size}, {seq_len})"
        )
    if position_ids.shape[0] == 1:
        row = lengths_from_position_ids(position_ids[0])
        return row * batch_size
    lengths: list[int] = []
    for b in range(batch_size):
        lengths += lengths_from_position_ids(position_ids[b])
    return lengths


@dataclass(frozen=True)
class Unpadded:
    """Where the valid tokens of a padded (B, S) batch sit in its flattened (B * S) rows."""

    indices: torch.Tensor
    """(T,) long: flat row ``b * S + s`` of every valid token, row-major (so each row's tokens stay in order)."""
    lengths: list[int]
    """Valid tokens per batch row (one causal document per row; 0 for a fully padded row)."""
    total_rows: int
    """B * S, the flattened size to scatter back to."""


def unpad(padding_mask: torch.Tensor) -> Unpadded:
    """Unpadding indices of a 2-D padding mask (B, S) (True / nonzero = real token).

    Works for right and left padding, and for holes: the valid tokens of a row are one document.
    """
    if padding_mask.dim() != 2:
        raise ValueError(f"a padding mask is 2-D (batch, seq), got shape {tuple(padding_mask.shape)}")
    valid = padding_mask.bool()  # (B, S)
    indices = valid.reshape(-1).nonzero().flatten()  # (T,)
    lengths = valid.sum(dim=1).tolist()
    return Unpadded(indices=indices, lengths=[int(n) for n in lengths], total_rows=valid.numel())


def scatter_rows(values: torch.Tensor, unpadded: Unpadded) -> torch.Tensor:
    """Inverse of gathering ``x.reshape(B * S, ...)[unpadded.indices]``: (T, ...) -> (B * S, ...), zeros at padding.

    Differentiable (the gradient of a padded position is dropped, as it should).
    """
    out = values.new_zeros((unpadded.total_rows, *values.shape[1:]))  # (B * S, ...)
    return out.index_copy(0, unpadded.indices, values)


def pieces_from_lengths(lengths: Sequence[int]) -> list[tuple[int, int, int]]:
    """One engine piece ``(doc_id, 0, length)`` per non-empty local document, doc ids 0, 1, ... in order."""
    pieces: list[tuple[int, int, int]] = []
    for n in lengths:
        if n > 0:
            pieces.append((len(pieces), 0, int(n)))
    return pieces


def cu_seqlens_from_lengths(lengths: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """Cumulative offsets (N + 1,) int32 of the non-empty documents in ``lengths``."""
    offsets = [0]
    for n in lengths:
        if n > 0:
            offsets.append(offsets[-1] + int(n))
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def _as_list(values: torch.Tensor | Sequence[int], name: str) -> list[int]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(values.shape)}")
        return [int(x) for x in values.tolist()]
    return [int(x) for x in values]
