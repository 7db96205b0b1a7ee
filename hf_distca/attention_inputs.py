"""What the ``distca`` attention function reads from Transformers' inputs, derived once per forward.

Every layer of a forward receives the same mask and packing tensors, and deriving document boundaries
from them needs a host synchronisation: it runs once per forward, not per layer, and the result is kept
in a one-slot cache (checked by the source tensors' identity and version) that the engine state holds
(:attr:`hf_distca.engine.state.EngineState.forward_inputs`).

- :func:`padding_mask`: the 2-D padding mask, refusing 4-D and additive masks;
- :func:`mask_has_padding`: whether a 2-D mask masks anything, read on the host once per mask tensor
  (where the mask is first seen: its build, before the layers) and reused by every layer;
- :func:`local_batch`: without past keys, the documents of packed rows (``cu_seq_lens_q/k``, else
  ``position_ids``, else one per row) or of padded rows (unpadded);
- :func:`past_batch`: with past keys (a KV cache), one sequence per row whose queries are its last
  positions.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_distca.engine.state import EngineState
from hf_distca.packing import Unpadded, cu_seqlens_from_lengths, packed_document_lengths, unpad

__all__ = [
    "LocalBatch",
    "MaskVerdicts",
    "OneSlotCache",
    "PastBatch",
    "local_batch",
    "mask_has_padding",
    "padding_mask",
    "remember_mask",
    "past_batch",
]


@dataclass
class LocalBatch:
    """The documents of a forward without past keys: their lengths, and the unpadding of padded rows."""

    lengths: list[int]
    unpadded: Unpadded | None
    max_len: int
    cu_seqlens: dict[str, torch.Tensor] = field(default_factory=dict)

    def cu(self, device: torch.device) -> torch.Tensor:
        key = str(device)
        if key not in self.cu_seqlens:
            self.cu_seqlens[key] = cu_seqlens_from_lengths(self.lengths, device=device)
        return self.cu_seqlens[key]


class OneSlotCache:
    """Remembers the value derived from the last set of source tensors (their identity, through weak
    references, and their versions checked)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._refs: tuple = ()
        self._value: Any = None

    @staticmethod
    def _fingerprint(sources: tuple) -> tuple | None:
        parts = []
        for t in sources:
            if t is None:
                parts.append(None)
                continue
            if not isinstance(t, torch.Tensor):
                return None  # e.g. offsets given as a list: cheap to re-derive, not cached
            try:
                parts.append(t._version)  # identity: the weak references of put
            except RuntimeError:  # inference tensors have no version counter: do not cache
                return None
        return tuple(parts)

    def get(self, shape: tuple, sources: tuple) -> Any:
        fp = self._fingerprint(sources)
        if fp is None or self._key != (shape, fp):
            return None
        for ref, t in zip(self._refs, sources):
            if ref is not None and ref() is not t:
                return None
        return self._value

    def put(self, shape: tuple, sources: tuple, value: Any) -> None:
        fp = self._fingerprint(sources)
        if fp is None:
            return
        self._key = (shape, fp)
        self._refs = tuple(weakref.ref(t) if isinstance(t, torch.Tensor) else None for t in sources)
        self._value = value


MASK_VERDICTS = 8
"""Masks whose verdict is remembered (a forward's, its nano-batches', the next forward's)."""


class MaskVerdicts:
    """Whether each recent 2-D mask tensor masks anything, by the tensor object (a weak reference) and
    its version: the host read of a mask's verdict happens once per mask tensor, not once per layer.

    Several slots, not one: under layer-level ping-pong the nano-batches' forwards alternate layer by
    layer, each with its own mask."""

    def __init__(self) -> None:
        self._slots: list[tuple[weakref.ref, int, bool]] = []  # the oldest first

    def get(self, mask: torch.Tensor) -> bool | None:
        for ref, version, padded in self._slots:
            if ref() is mask:  # this very tensor (never its id: a dead tensor's id is reused)
                return padded if version == _version(mask) else None
        return None

    def put(self, mask: torch.Tensor, padded: bool) -> None:
        version = _version(mask)
        if version is None:
            return  # an inference tensor has no version counter: not remembered
        kept = [slot for slot in self._slots if slot[0]() is not None and slot[0]() is not mask]
        self._slots = [*kept, (weakref.ref(mask), version, padded)][-MASK_VERDICTS:]


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return None


def _masks_anything(mask: torch.Tensor) -> bool:
    """The host read: whether ``mask`` (2-D, 0/1 or boolean) holds a zero (one device synchronisation)."""
    return not bool(mask.bool().all())


def mask_has_padding(state: EngineState, mask: torch.Tensor) -> bool:
    """Whether the 2-D padding ``mask`` masks any position, read on the host once per mask tensor and
    remembered in ``state`` (:class:`MaskVerdicts`); :func:`remember_mask` records a verdict known
    without reading (a mask returned because it masks something)."""
    verdicts = state.forward_inputs.setdefault("mask_verdicts", MaskVerdicts())
    known = verdicts.get(mask)
    if known is None:
        known = _masks_anything(mask)
        verdicts.put(mask, known)
    return known


def remember_mask(state: EngineState, mask: torch.Tensor, padded: bool) -> None:
    """Record ``mask``'s verdict (see :func:`mask_has_padding`) without reading it."""
    state.forward_inputs.setdefault("mask_verdicts", MaskVerdicts()).put(mask, padded)


def _cache(state: EngineState, name: str) -> OneSlotCache:
    """``state``'s one-slot cache ``name`` ("local": the last forward without past keys; "past": with)."""
    return state.forward_inputs.setdefault(name, OneSlotCache())


def padding_mask(
    attention_mask: torch.Tensor | None, batch: int, seq: int, kv_len: int | None = None
) -> torch.Tensor | None:
    """The 2-D padding mask (B, n) with seq <= n <= kv_len (see :func:`hf_distca.attention.distca_padding_mask`), or None.

    ``kv_len``: the number of keys (default ``seq``: no past keys). Refuses 4-D and additive masks."""
    kv_len = seq if kv_len is None else kv_len
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(
            f"attn_implementation='distca' got a {attention_mask.dim()}-D attention mask of shape "
            f"{tuple(attention_mask.shape)}; distca builds causality and document boundaries itself. Pass a 2-D "
            "padding mask (batch, seq) or none (for packed batches use DataCollatorWithFlattening), or use "
            "attn_implementation='sdpa' for custom masks"
        )
    if attention_mask.is_floating_point():
        raise ValueError(
            "attn_implementation='distca' expects a boolean or 0/1 integer padding mask, got dtype "
            f"{attention_mask.dtype}; pass the tokenizer's attention_mask unchanged"
        )
    if attention_mask.shape[0] != batch or not seq <= attention_mask.shape[1] <= kv_len:
        raise ValueError(
            f"padding mask shaped {tuple(attention_mask.shape)} does not fit a batch of {batch} rows with {seq} "
            f"queries and {kv_len} keys: it must be (batch, n) with {seq} <= n <= {kv_len} (the tokens so far, "
            "past keys included)"
        )
    return attention_mask


def local_batch(
    state: EngineState, batch: int, seq: int, mask: torch.Tensor | None, kwargs: dict
) -> LocalBatch:
    """The documents of ``batch`` rows of ``seq`` tokens (``mask``: from :func:`padding_mask`; ``kwargs``:
    the attention function's), cached in ``state`` across the layers of one forward."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    position_ids = kwargs.get("position_ids")
    sources = (mask, cu_q, cu_k, position_ids)
    hit = _cache(state, "local").get((batch, seq), sources)
    if hit is not None:
        return hit
    if mask is not None and not mask_has_padding(state, mask):
        mask = None  # a mask that masks nothing: fall back to packing kwargs / position ids
    if mask is not None:
        if cu_q is not None or cu_k is not None:
            raise ValueError(
                "got both a padding attention_mask and packed-sequence kwargs (cu_seq_lens_q/k); pass one: "
                "packed batches from DataCollatorWithFlattening need no attention_mask"
            )
        unpadded = unpad(mask)
        lengths = unpadded.lengths
    else:
        unpadded = None
        lengths = packed_document_lengths(
            batch, seq, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, position_ids=position_ids
        )
    value = LocalBatch(
        lengths=lengths,
        unpadded=unpadded,
        max_len=max(lengths, default=0),
    )
    _cache(state, "local").put((batch, seq), sources, value)
    return value


@dataclass
class PastBatch:
    """The valid queries and keys of a forward with past keys (a KV cache), one sequence per row."""

    q_index: torch.Tensor | None
    """(T_q,) rows of the valid queries in the flattened (B * S_q) queries; None: every query is valid."""
    kv_index: torch.Tensor | None
    """(T_k,) rows of the valid keys in the flattened (B * n) keys; None: every key is valid."""
    q_lengths: list[int]
    kv_lengths: list[int]
    """Per batch row: its valid queries and keys (both 0 for a row with no valid query)."""
    cu_q: torch.Tensor
    cu_k: torch.Tensor


def past_batch(
    state: EngineState, batch: int, seq: int, n: int, mask: torch.Tensor | None, device: torch.device
) -> PastBatch:
    """Varlen offsets of B sequences of ``n`` keys whose queries are the last ``seq`` positions.

    The valid queries of a row are exactly its last valid keys, so bottom-right causal attention over
    the unpadded row is causal attention over the row, padding excluded, whatever the padding pattern."""
    sources = (mask,)
    hit = _cache(state, "past").get((batch, seq, n, str(device)), sources)
    if hit is not None:
        return hit
    if mask is None:
        q_lengths, kv_lengths = [seq] * batch, [n] * batch
        q_index = kv_index = None
    else:
        valid = mask.to(device=device, dtype=torch.bool)  # (B, n)
        query_valid = valid[:, n - seq :]  # (B, S_q)
        valid = valid & query_valid.any(dim=1, keepdim=True)  # a row without valid queries drops out
        queries, keys = unpad(query_valid), unpad(valid)
        q_index, kv_index = queries.indices, keys.indices
        q_lengths, kv_lengths = queries.lengths, keys.lengths
    value = PastBatch(
        q_index=q_index,
        kv_index=kv_index,
        q_lengths=q_lengths,
        kv_lengths=kv_lengths,
        cu_q=cu_seqlens_from_lengths(q_lengths, device=device),
        cu_k=cu_seqlens_from_lengths(kv_lengths, device=device),
    )
    _cache(state, "past").put((batch, seq, n, str(device)), sources, value)
    return value
