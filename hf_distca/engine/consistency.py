"""Cross-rank consistency of the engine's inputs: one small all-gather, every rank raises together.

Every rank plans from its own copy of the inputs, so ranks that disagree (a different ``all_pieces``,
config, dtype or head count) would plan differently and then hang or exchange garbage in the
all-to-all; a rank whose input is malformed and raises alone leaves the others blocked. So, once per
new micro-batch layout, every rank describes its inputs as a fixed-size int64 vector (an error code for
local validation failures, row counts, dtype, heads, a digest of the pieces, each DistCAConfig field)
and all ranks all-gather the vectors. Every rank then makes the same decision from the same gathered
vectors: all go on, or all raise. A rank whose own input failed validation raises its own detailed
error; the others raise :class:`InconsistentInputError` naming that rank and what it reported.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_distca.config import DistCAConfig, cost_model_from_config
from hf_distca.kernels import KERNEL_BACKENDS

Pieces = list[tuple[int, int, int]]


class InconsistentInputError(ValueError):
    """The ranks of the attention group called the engine with inputs that disagree, or another rank's
    input is malformed (its own error names the problem)."""


class PlanMismatchError(InconsistentInputError):
    """The ranks of the attention group made different plans from inputs that passed the check (a cost
    model, sliding window or planner that differs between ranks): every rank raises it, the same text."""


# local validation outcome (the "status" entry of the vector)
OK, BAD_TENSORS, BAD_PIECES, BAD_ALL_PIECES = 0, 1, 2, 3
SEVERAL_ROWS, PADDED_ROW = 4, 5
"""Caller statuses: what the engine's caller (the attention function) found wrong with a rank's call."""
_STATUS_TEXT = {
    BAD_TENSORS: "malformed q/k/v tensors",
    BAD_PIECES: "pieces that do not describe its local rows",
    BAD_ALL_PIECES: "an all_pieces list that does not match its own pieces or the group size",
    SEVERAL_ROWS: "a distca_layout with a batch of several rows (the layout describes one packed row (1, S): "
    "use DataCollatorWithFlattening or DistCA's data path)",
    PADDED_ROW: "a distca_layout with a padded packed row (its attention_mask marks padding, but every token "
    "of the layout is a real one: drop the attention_mask)",
}


class CallerInputError(InconsistentInputError):
    """What the engine's caller found wrong with this rank's call (a caller status); handed to the engine
    (``core_attention(caller_error=...)``), which raises it on every rank of the group together, with the
    same text, at the consistency check."""

    def __init__(self, status: int) -> None:
        super().__init__(_STATUS_TEXT[status])
        self.status = status


_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def digest64(value: Any) -> int:
    """A signed 64-bit digest of ``repr(value)`` (identical in every process)."""
    return int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:8], "little", signed=True)


def normalize_pieces(pieces: Sequence[Sequence[int]], what: str) -> Pieces:
    out = []
    for p in pieces:
        if len(p) != 3:
            raise ValueError(f"{what}: a piece is (doc_id, doc_start, length), got {tuple(p)!r}")
        out.append((int(p[0]), int(p[1]), int(p[2])))
    return out


@dataclass
class LocalInputs:
    """What this rank was called with, validated without raising (the error is kept for later)."""

    rank: int
    world: int
    status: int = OK
    error: Exception | None = None
    rows: int = -1
    piece_rows: int = -1
    dtype: int = -1
    q_heads: int = -1
    kv_heads: int = -1
    head_dim: int = -1
    pieces: Pieces = field(default_factory=list)
    pieces_digest: int = 0
    all_pieces: list[Pieces] | None = None
    all_pieces_digest: int = 0
    entry_digests: list[int] = field(default_factory=list)
    """digest64 of each rank's entry of this rank's all_pieces (to tell which entry differs)."""

    def fail(self, status: int, error: Exception) -> LocalInputs:
        if self.status == OK:
            self.status, self.error = status, error
        return self

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error


def describe_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pieces: Sequence[Sequence[int]],
    all_pieces: Sequence[Sequence[Sequence[int]]] | None,
    rank: int,
    world: int,
    caller_error: CallerInputError | None = None,
) -> LocalInputs:
    """Validate this rank's inputs; an invalid input sets ``status``/``error`` instead of raising
    (``caller_error`` first: it explains the rest, e.g. several rows make the row count wrong)."""
    info = LocalInputs(rank=rank, world=world)
    if caller_error is not None:
        info.fail(caller_error.status, caller_error)
    try:
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            raise ValueError(
                f"core_attention expects (T, H, D) tensors, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )
        info.rows = q.shape[0]
        info.q_heads, info.kv_heads, info.head_dim = q.shape[1], k.shape[1], q.shape[2]
        info.dtype = _DTYPES.index(q.dtype) if q.dtype in _DTYPES else digest64(str(q.dtype))
        if not (q.shape[0] == k.shape[0] == v.shape[0]):
            raise ValueError(f"q, k, v hold different token counts: {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
        if k.shape != v.shape or k.shape[2] != q.shape[2]:
            raise ValueError(
                f"k and v must be shaped (T, H_kv, D) with q's D: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                f"v {tuple(v.shape)}"
            )
        if not (q.dtype == k.dtype == v.dtype):
            raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
            raise ValueError(
                f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})"
            )
    except ValueError as err:
        info.fail(BAD_TENSORS, err)
    try:
        info.pieces = normalize_pieces(pieces, f"rank {rank}")
        info.piece_rows = sum(p[2] for p in info.pieces)
        info.pieces_digest = digest64(info.pieces)
        if info.rows >= 0 and info.piece_rows != info.rows:
            raise ValueError(
                f"rank {rank}: pieces cover {info.piece_rows} tokens but q holds {info.rows}; pieces must "
                "describe every local token in local order"
            )
    except (TypeError, ValueError) as err:
        info.fail(BAD_PIECES, err)
    if all_pieces is not None:
        try:
            normalized = [normalize_pieces(p, f"all_pieces[{r}]") for r, p in enumerate(all_pieces)]
            info.all_pieces = normalized
            info.entry_digests = [digest64(p) for p in normalized]
            info.all_pieces_digest = digest64(info.entry_digests)
            if len(normalized) != world or normalized[rank] != info.pieces:
                raise ValueError(
                    f"all_pieces must list the pieces of all {world} ranks of the group, with this rank's "
                    f"(rank {rank}) equal to `pieces`; got {len(normalized)} entries"
                    + ("" if len(normalized) != world else f" and entry {rank} = {normalized[rank][:4]}...")
                )
        except (TypeError, ValueError) as err:
            info.fail(BAD_ALL_PIECES, err)
    return info


# ------------------------------------------------------------------------------------ the vector
_CALLER_STATUSES = (SEVERAL_ROWS, PADDED_ROW)
_HEAD = ["status", "rows", "piece_rows", "dtype", "q_heads", "kv_heads", "head_dim", "pieces", "all_pieces"]
_AT = {name: i for i, name in enumerate(_HEAD)}  # position of each entry in the vector
_TAG_NONE, _TAG_INT, _TAG_FLOAT, _TAG_STR, _TAG_OTHER = range(5)


def _encode(value: Any) -> tuple[int, int]:
    if value is None:
        return _TAG_NONE, 0
    if isinstance(value, bool | int):
        return _TAG_INT, int(value)
    if isinstance(value, float):
        return _TAG_FLOAT, struct.unpack("<q", struct.pack("<d", value))[0]
    if isinstance(value, str):
        return _TAG_STR, digest64(value)
    return _TAG_OTHER, digest64(value)


def _decode(tag: int, payload: int, known: dict[int, str]) -> str:
    if tag == _TAG_NONE:
        return "None"
    if tag == _TAG_INT:
        return str(payload)
    if tag == _TAG_FLOAT:
        return repr(struct.unpack("<d", struct.pack("<q", payload))[0])
    return known.get(payload, f"<value with digest {payload & 0xFFFFFFFF:08x}>")


def _config_fields(config: DistCAConfig) -> list[tuple[str, Any]]:
    """Every config field, plus the cost model it loads (the same cost_table path may hold different
    tables on different ranks; the model's repr carries its table's hash)."""
    fields = [(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)]
    return [*fields, ("cost model", repr(cost_model_from_config(config)))]


def check_vector(info: LocalInputs, config: DistCAConfig) -> list[int]:
    """This rank's fixed-size description (same length on every rank for one DistCAConfig class)."""
    head = [
        info.status,
        info.rows,
        info.piece_rows,
        info.dtype,
        info.q_heads,
        info.kv_heads,
        info.head_dim,
        info.pieces_digest,
        info.all_pieces_digest,
    ]
    for _, value in _config_fields(config):
        head.extend(_encode(value))
    return head


def _by_value(values: list[str]) -> str:
    groups: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(v, []).append(r)
    return "; ".join(f"{v} on rank(s) {ranks}" for v, ranks in groups.items())


def raise_on_disagreement(
    vectors: list[list[int]],
    info: LocalInputs,
    config: DistCAConfig,
    *,
    compare_inputs: bool,
    compare_all_pieces: bool,
) -> None:
    """Raise on every rank when any rank failed validation or (``compare_inputs``) the ranks' inputs
    differ; else return. ``vectors``: every rank's :func:`check_vector`, identical on all ranks, so all
    ranks decide alike; ``compare_all_pieces``: whether the vectors carry an all_pieces digest."""
    failed = [r for r, vec in enumerate(vectors) if vec[_AT["status"]] != OK]
    if failed:
        if info.status not in _CALLER_STATUSES:
            info.raise_if_failed()  # this rank's own, detailed error
        reasons, detailed = [], []
        for r in failed:
            status, rows, piece_rows = (vectors[r][_AT[n]] for n in ("status", "rows", "piece_rows"))
            text = _STATUS_TEXT.get(status, f"error code {status}")
            if status == BAD_PIECES and rows >= 0 and piece_rows >= 0:
                text += f" (its pieces cover {piece_rows} tokens but its q holds {rows})"
            reasons.append(f"rank {r} passed {text}")
            if status not in _CALLER_STATUSES:
                detailed.append(r)
        see = f"; see the error raised on rank(s) {detailed}" if detailed else ""
        # a caller status is described in full here: every rank, that one included, raises this same text
        raise InconsistentInputError(
            f"core_attention: {'; '.join(reasons)}{see}. Every rank of the attention group stops here instead "
            "of waiting for them."
        ) from info.error
    if not compare_inputs:
        return
    problems = []
    for name in ("dtype", "q_heads", "kv_heads", "head_dim"):
        column = [vec[_AT[name]] for vec in vectors]
        if len(set(column)) > 1:
            shown = [_DTYPES[c] if name == "dtype" and 0 <= c < len(_DTYPES) else c for c in column]
            problems.append(f"{name}: {_by_value([str(s) for s in shown])}")
    if compare_all_pieces and len({vec[_AT["all_pieces"]] for vec in vectors}) > 1:
        wrong = [r for r, vec in enumerate(vectors) if info.entry_digests[r] != vec[_AT["pieces"]]]
        here = (
            f"this rank's (rank {info.rank}) all_pieces entries for rank(s) {wrong} differ from the pieces "
            "those ranks passed"
            if wrong
            else f"this rank's (rank {info.rank}) all_pieces agrees with every rank's own pieces"
        )
        groups = _by_value([f"digest {vec[_AT['all_pieces']] & 0xFFFFFFFF:08x}" for vec in vectors])
        problems.append(f"all_pieces differs between ranks ({groups})")
    known = {digest64(b): repr(b) for b in KERNEL_BACKENDS}  # names for string digests
    offset = len(_HEAD)
    for j, (name, value) in enumerate(_config_fields(config)):
        if isinstance(value, str):
            known[digest64(value)] = repr(value)
        tags = [(vec[offset + 2 * j], vec[offset + 2 * j + 1]) for vec in vectors]
        if len(set(tags)) > 1:
            values = [_decode(t, p, known) for t, p in tags]
            problems.append(f"DistCAConfig.{name}: {_by_value(values)}")
    if problems:
        error = InconsistentInputError(
            f"core_attention: the {len(vectors)} ranks of the attention group disagree on their inputs: "
            + " | ".join(problems)
            + ". Every rank must use the same DistCAConfig, dtype and model shape, and the same all_pieces "
            "(each rank's entry equal to that rank's pieces)."
        )
        if compare_all_pieces and len({vec[_AT["all_pieces"]] for vec in vectors}) > 1:
            error.add_note(here)  # what only this rank can tell: the message itself is every rank's
        raise error


def raise_on_plan_mismatch(digests: list[int]) -> None:
    """Raise :class:`PlanMismatchError` on every rank (the same text) when the ranks' plan digests
    ``digests`` (every rank's, in rank order: identical on all ranks) differ."""
    if len(set(digests)) == 1:
        return
    groups = _by_value([f"digest {d & 0xFFFFFFFF:08x}" for d in digests])
    raise PlanMismatchError(
        f"core_attention: the {len(digests)} ranks of the attention group made different plans of one micro-batch "
        f"from inputs that passed the consistency check ({groups}). Every rank must plan with the same cost "
        "model (cost_table, the probes' results), sliding windows and hf_distca version; every rank stops here "
        "instead of exchanging rows under different plans."
    )
