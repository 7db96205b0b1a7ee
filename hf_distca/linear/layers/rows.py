"""Which documents a linear-attention layer's (B, S) input holds: one place for every replaced layer."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hf_distca.packing import packed_document_lengths

__all__ = ["cu_seqlens_of", "input_pieces"]


def input_pieces(
    batch: int,
    seq: int,
    *,
    mask: torch.Tensor | None,
    kwargs: Mapping,
    position_ids: torch.Tensor | None,
) -> tuple[list[tuple[int, int, int]], tuple | None]:
    """(this rank's pieces, every rank's pieces) of the flattened rows.

    With a ``distca_layout`` kwarg (one unpadded packed row: documents continue across ranks) its pieces;
    else every document whole on this rank (every rank's pieces None): one document per row of a padded
    batch (``mask``, (B, S)), else documents from ``cu_seq_lens_q``/``_k``, else from ``position_ids``,
    else one per row."""
    layout = kwargs.get("distca_layout")
    if layout is not None:
        if batch != 1 or (mask is not None and not bool(mask.bool().all())):
            raise ValueError(
                "with a distca_layout the batch must be one unpadded packed row (1, S), got "
                f"({batch}, {seq}){' with padding' if mask is not None else ''}"
            )
        return list(layout.pieces), layout.all_pieces
    if mask is not None:
        lengths = [seq] * batch
    else:
        lengths = packed_document_lengths(
            batch,
            seq,
            cu_seq_lens_q=kwargs.get("cu_seq_lens_q"),
            cu_seq_lens_k=kwargs.get("cu_seq_lens_k"),
            position_ids=position_ids,
        )
    return [(doc, 0, int(n)) for doc, n in enumerate(lengths)], None


def cu_seqlens_of(pieces: list[tuple[int, int, int]]) -> list[int]:
    """Offsets of whole-document pieces laid out back to back: [0, n_0, n_0 + n_1, ...]."""
    cu = [0]
    for _, _, length in pieces:
        cu.append(cu[-1] + int(length))
    return cu
