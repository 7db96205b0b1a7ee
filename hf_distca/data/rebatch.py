"""layout_micro_batch: lay one global micro-batch of documents out over the ranks, equal tokens each.

Every rank receives the same documents (token ids) and computes the same layout (deterministic,
nothing is exchanged). Each rank ends up with exactly ``tokens_per_rank`` tokens (padding included),
so everything but core attention is balanced; core attention is rebalanced later by the planner, using
the pieces recorded here. Two placements:

- :func:`layout_balanced` (the default): documents go, most expensive first, to the rank with the
  least estimated cost (causal attention pairs plus a per-token term), and a document whose attention
  alone exceeds a rank's fair share is cut head/tail over several ranks (balanced packing in the style
  of WLB-LLM). The layout is then already close to balanced, so the planner moves little and long
  documents' KV prefixes are spread over several holders instead of one (in the simulator,
  benchmarks/simulate.py, this cut DistCA's exposed all-to-all time 1.4-3x on one node of 8 GPUs and
  1.7-21x across nodes with the balance-only planner, where one holder's NIC carried every copy of a
  long document's prefix).
- :func:`layout_pieces` (token-only: the exact-unbalanced baseline), documents taken longest first
  (ties: lower index first): a document that fits whole on the rank with the most free space (ties:
  lower rank) goes there; otherwise it is cut over the fewest ranks that can hold it, taken by most
  free space.

A cut document gets shares as equal as the ranks' free space allows ("water filling"). Each rank's
share is split in a head half and a tail half laid out as
``head_0 head_1 ... head_{k-1} tail_{k-1} ... tail_1 tail_0`` along the document ("zigzag"). With
equal shares this is exactly the 2k-chunk scheme (rank j holds chunks j and 2k-1-j), whose causal work
sum(position + 1) is the same on every rank: the early, cheap head of a rank is paired with a late,
expensive tail. The two halves of the last rank are adjacent and form one piece.
The padding needed to reach ``tokens_per_rank`` (only the remainder of each rank) is rank r's own
pseudo-document ``len(docs) + r``: it attends only to itself, never to real tokens.

Labels are shifted on the whole document before cutting, so a piece that ends mid-document keeps
the target of its last token (the first token of the next piece).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hf_distca.planning.cost import LINEAR_PAIRS_PER_TOKEN, causal_pairs
from hf_distca.planning.pieces import Piece

IGNORE_INDEX = -100
"""Label of tokens without a target (last token of a document, padding); ignored by the loss."""

__all__ = [
    "IGNORE_INDEX",
    "LINEAR_PAIRS_PER_TOKEN",
    "LayoutFn",
    "RankBatch",
    "layout_balanced",
    "layout_for_rank",
    "layout_micro_batch",
    "layout_pieces",
]

LayoutFn = Callable[..., list[tuple[Piece, ...]]]
"""A layout: ``fn(doc_lengths, *, world_size, tokens_per_rank, min_piece_tokens)`` -> every rank's pieces,
tiling each document exactly once, each rank holding exactly ``tokens_per_rank`` tokens (padding as
rank r's pseudo-document ``len(doc_lengths) + r``), like :func:`layout_pieces`."""


@dataclass(frozen=True)
class RankBatch:
    """One rank's share of a global micro-batch."""

    input_ids: torch.Tensor
    """LongTensor (1, tokens_per_rank): token ids, pieces in local order, padding last."""
    position_ids: torch.Tensor
    """LongTensor (1, tokens_per_rank): the true position of each token in its document (RoPE sees
    global positions even for a piece that starts mid-document); padding counts 0, 1, ..."""
    shift_labels: torch.Tensor
    """LongTensor (1, tokens_per_rank): id of the next token of the same document, -100 at the last
    token of each document and on padding (already shifted: do not shift again)."""
    pieces: tuple[Piece, ...]
    """(doc_id, doc_start, length) of this rank, in local order, covering all its tokens; padding is
    the piece of pseudo-document ``num_docs + rank``."""
    all_pieces: tuple[tuple[Piece, ...], ...]
    """Every rank's ``pieces`` (identical on all ranks): the input of the core-attention planner."""
    num_targets: int
    """Tokens of this rank with a target (shift_labels != -100)."""
    global_num_targets: int
    """Targets of the whole micro-batch over all ranks (sum of len(doc) - 1): the token-weighted
    loss denominator, known without a collective."""
    rank: int
    """The rank this batch belongs to."""
    num_docs: int
    """Number of real documents: doc ids >= num_docs are padding."""


def layout_pieces(
    doc_lengths: Sequence[int], *, world_size: int, tokens_per_rank: int, min_piece_tokens: int = 1
) -> list[tuple[Piece, ...]]:
    """Pieces of every rank for documents of these lengths (metadata only, no tokens).

    ``min_piece_tokens``: a rank whose share of a cut document is shorter than twice this gets it
    as one chunk instead of a head and a tail, avoiding pieces too short for efficient kernels.
    """
    _check_positive("world_size", world_size)
    _check_positive("tokens_per_rank", tokens_per_rank)
    _check_positive("min_piece_tokens", min_piece_tokens)
    lengths = [int(n) for n in doc_lengths]
    if any(n < 0 for n in lengths):
        raise ValueError(f"document lengths must be >= 0, got {lengths}")
    total, capacity = sum(lengths), world_size * tokens_per_rank
    if total > capacity:
        raise ValueError(
            f"{len(lengths)} documents hold {total} tokens, more than world_size x tokens_per_rank = "
            f"{world_size} x {tokens_per_rank} = {capacity}; plan smaller micro-batches "
            "(plan_global_batches with tokens_per_step = micro_batches x world_size x tokens_per_rank)"
        )

    free = [tokens_per_rank] * world_size
    placed: list[list[Piece]] = [[] for _ in range(world_size)]
    for doc in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[doc]
        if length == 0:
            continue
        by_free = sorted(range(world_size), key=lambda r: (-free[r], r))
        if free[by_free[0]] >= length:
            rank = by_free[0]
            placed[rank].append(Piece(doc, 0, length))
            free[rank] -= length
            continue
        # fewest ranks (most free first) whose free space holds the document
        ranks, room = [], 0
        for r in by_free:
            ranks.append(r)
            room += free[r]
            if room >= length:
                break
        shares = _water_fill([free[r] for r in ranks], length)
        for rank, doc_start, n in _zigzag(ranks, shares, min_piece_tokens):
            placed[rank].append(Piece(doc, doc_start, n))
            free[rank] -= n

    pad_base = len(lengths)
    for rank in range(world_size):
        placed[rank] = _merge_adjacent(placed[rank])
        if free[rank]:
            placed[rank].append(Piece(pad_base + rank, 0, free[rank]))
    return [tuple(p) for p in placed]


def _lengths(doc_lengths: Sequence[int], world_size: int, tokens_per_rank: int) -> list[int]:
    _check_positive("world_size", world_size)
    _check_positive("tokens_per_rank", tokens_per_rank)
    lengths = [int(n) for n in doc_lengths]
    if any(n < 0 for n in lengths):
        raise ValueError(f"document lengths must be >= 0, got {lengths}")
    if sum(lengths) > world_size * tokens_per_rank:
        raise ValueError(
            f"{len(lengths)} documents hold {sum(lengths)} tokens, more than world_size x tokens_per_rank = "
            f"{world_size} x {tokens_per_rank} = {world_size * tokens_per_rank}; plan smaller micro-batches "
            "(plan_global_batches with tokens_per_step = micro_batches x world_size x tokens_per_rank)"
        )
    return lengths


def _finish(placed: list[list[Piece]], free: list[int], num_docs: int) -> list[tuple[Piece, ...]]:
    """Merge touching pieces of one document and pad every rank to its budget."""
    out = []
    for rank, pieces in enumerate(placed):
        pieces = _merge_adjacent(pieces)
        if free[rank]:
            pieces.append(Piece(num_docs + rank, 0, free[rank]))
        out.append(tuple(pieces))
    return out


def layout_balanced(
    doc_lengths: Sequence[int],
    *,
    world_size: int,
    tokens_per_rank: int,
    min_piece_tokens: int = 1,
    linear_pairs_per_token: float = LINEAR_PAIRS_PER_TOKEN,
    ranks_per_node: int | None = None,
) -> list[tuple[Piece, ...]]:
    """Balanced packing with per-document context parallelism (WLB-LLM style).

    Estimated cost of a rank: its causal (query, key) pairs with full context (``causal_pairs(a, b)`` per
    piece ``[a, b)``) plus ``linear_pairs_per_token`` per token, counting at least the mean tokens per
    rank of the micro-batch: every rank ends up with about that many (all of them when the micro-batch
    fills the budget), so a rank that holds fewer tokens so far is not cheaper for it; only tokens above
    the mean add cost. Documents are taken longest first (ties: lower index first).

    - A document is split over ``k = max(ceil(length / tokens_per_rank), ceil(pairs / fair))`` ranks
      (at most ``world_size``), ``fair`` being the micro-batch's attention pairs over ``world_size``:
      a document whose attention alone exceeds one rank's fair share is cut. Across nodes
      (``ranks_per_node`` given, more than one node), where moving work off a node costs inter-node
      transfers: each rank of a cut document still fills the rest of its room (up to the mean tokens per
      rank) with the documents placed last, the shortest, so ``k`` grows until a share plus that fill is
      about fair:
      ``k >= (pairs - length d) / (fair - mean_tokens d)``, ``d`` the pairs per token of the shortest
      documents that hold the ``k`` ranks' room (:func:`_fill_density`; a full micro-batch leaves no
      other room for them, and without this the nodes holding shares of long documents carried ~1.2x
      the mean attention in benchmarks/simulate.py at 512 ranks). Inside one node the planner evens the
      ranks out over the fast links (and on few ranks cutting a document over all of them can leave no
      rank for the next large one), so there the count stays the plain one. The ``k`` ranks with the
      least estimated cost that have room take shares as equal as their room allows, each share a
      head and a tail of the document laid out ``head_0 .. head_{k-1} tail_{k-1} .. tail_0`` (equal
      causal work per rank for equal shares); more ranks join when those ``k`` lack the room.
    - Any other document goes whole to the rank with the least estimated cost among those with room
      for it (ties: most room, then lower rank); when none has room it is split as above over two or
      more ranks.
    - ``ranks_per_node`` (ranks [k n, (k + 1) n) share node k, as ``DistCAConfig.ranks_per_node``): a
      document cut over at most that many ranks is cut over ranks of one node, the one whose ``k``
      least loaded ranks carry the least load among nodes with room for it, so that its pieces read
      each other's KV over the node's fast links. None: nodes are not known.

    Ranks hold at most ``tokens_per_rank`` tokens, the memory budget every system gets; the global
    micro-batch nearly fills it, so the balance comes from which documents go where and from the
    splits, not from unequal token counts.
    """
    lengths = _lengths(doc_lengths, world_size, tokens_per_rank)
    _check_positive("min_piece_tokens", min_piece_tokens)
    if not linear_pairs_per_token >= 0:
        raise ValueError(f"linear_pairs_per_token must be >= 0, got {linear_pairs_per_token!r}")

    fair = sum(causal_pairs(0, n) for n in lengths) / world_size
    mean_tokens = sum(lengths) / world_size
    placed: list[list[Piece]] = [[] for _ in range(world_size)]
    free = [tokens_per_rank] * world_size
    pairs = [0] * world_size
    load = [linear_pairs_per_token * mean_tokens] * world_size  # estimated cost: see the docstring

    def add(rank: int, doc: int, doc_start: int, n: int) -> None:
        placed[rank].append(Piece(doc, doc_start, n))
        free[rank] -= n
        pairs[rank] += causal_pairs(doc_start, doc_start + n)
        tokens = max(tokens_per_rank - free[rank], mean_tokens)
        load[rank] = linear_pairs_per_token * tokens + pairs[rank]

    several_nodes = ranks_per_node is not None and world_size > ranks_per_node
    fill_density = _fill_density(lengths) if several_nodes else None
    for doc in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[doc]
        if length == 0:
            continue
        # fair > 0: this document has attention pairs
        pairs_doc = causal_pairs(0, length)
        k = max(math.ceil(length / tokens_per_rank), math.ceil(pairs_doc / fair))
        rounds = _FILL_ROUNDS if k > 1 and several_nodes else 0
        for _ in range(rounds):  # k only grows, as the room to fill and its density
            room = k * mean_tokens - length
            d = fill_density(room) if room > 0 else 0.0
            if room <= 0 or fair <= mean_tokens * d:
                break  # no room left to fill, or the fill alone reaches a fair share
            more = max(k, math.ceil((pairs_doc - length * d) / (fair - mean_tokens * d)))
            if more == k:
                break
            k = more
            if k >= world_size:
                break
        k = min(k, world_size)
        if k == 1:
            fits = [r for r in range(world_size) if free[r] >= length]
            if fits:
                add(min(fits, key=lambda r: (load[r], -free[r], r)), doc, 0, length)
                continue
            k = 2  # no rank has room for it whole
        by_load = sorted((r for r in range(world_size) if free[r] > 0), key=lambda r: (load[r], -free[r], r))
        if ranks_per_node is not None and k <= ranks_per_node < world_size:
            by_load = _one_node(by_load, k, length, free, load, ranks_per_node) or by_load
        ranks = by_load[:k]
        for r in by_load[k:]:
            if sum(free[x] for x in ranks) >= length:
                break
            ranks.append(r)
        shares = _water_fill([free[r] for r in ranks], length)
        for rank, doc_start, n in _zigzag(ranks, shares, min_piece_tokens):
            add(rank, doc, doc_start, n)
    return _finish(placed, free, len(lengths))


_FILL_ROUNDS = 4
"""Rounds of :func:`layout_balanced`'s fill-aware cut count (it settles within two or three)."""


def _fill_density(lengths: Sequence[int]) -> Callable[[float], float]:
    """``f(room)``: the causal pairs per token of the shortest documents of ``lengths`` that hold ``room``
    tokens (all of them when they hold fewer): what fills the room left on the ranks of a cut document,
    the balanced layout placing the longest documents first."""
    ascending = sorted(int(n) for n in lengths if n > 0)
    tokens = list(itertools.accumulate(ascending))
    pairs = list(itertools.accumulate(causal_pairs(0, n) for n in ascending))

    def density(room: float) -> float:
        if not tokens:
            return 0.0
        j = min(bisect.bisect_left(tokens, room), len(tokens) - 1)
        return pairs[j] / tokens[j]

    return density


def _one_node(
    by_load: list[int], k: int, length: int, free: list[int], load: list[float], ranks_per_node: int
) -> list[int] | None:
    """The ranks of one node (least loaded first) to cut a document over: the node whose ``k`` least
    loaded ranks carry the least load among nodes with room for the whole document; None if none has.
    A cut document's pieces then read each other's KV over the node's fast links."""
    best, best_key = None, None
    nodes: dict[int, list[int]] = {}
    for r in by_load:
        nodes.setdefault(r // ranks_per_node, []).append(r)
    for node, members in nodes.items():
        if sum(free[r] for r in members) < length:
            continue
        key = (sum(load[r] for r in members[:k]), node)
        if best_key is None or key < best_key:
            best, best_key = members, key
    return best


def layout_micro_batch(
    docs: Sequence[Sequence[int]],
    *,
    world_size: int,
    tokens_per_rank: int,
    pad_token_id: int = 0,
    min_piece_tokens: int = 1,
    layout: LayoutFn | None = None,
) -> list[RankBatch]:
    """Lay ``docs`` (token ids of one global micro-batch) out over ``world_size`` ranks.

    Returns one ``RankBatch`` per rank, each with exactly ``tokens_per_rank`` tokens. ``layout``: the
    function that places the pieces (default :func:`layout_balanced`; benchmarks pass the baselines of
    :mod:`hf_distca.data.baselines`).
    """
    arrays, all_pieces = _arrays_and_pieces(docs, world_size, tokens_per_rank, min_piece_tokens, layout)
    return [_materialize(arrays, all_pieces, r, tokens_per_rank, pad_token_id) for r in range(world_size)]


def _arrays_and_pieces(docs, world_size: int, tokens_per_rank: int, min_piece_tokens: int, layout):
    """Token arrays of the documents and every rank's pieces (the layout all ranks agree on)."""
    arrays = [_as_tokens(d, i) for i, d in enumerate(docs)]
    all_pieces = tuple(
        (layout or layout_balanced)(
            [len(a) for a in arrays],
            world_size=world_size,
            tokens_per_rank=tokens_per_rank,
            min_piece_tokens=min_piece_tokens,
        )
    )
    return arrays, all_pieces


def layout_for_rank(
    docs: Sequence[Sequence[int]],
    *,
    rank: int,
    world_size: int,
    tokens_per_rank: int,
    pad_token_id: int = 0,
    min_piece_tokens: int = 1,
    layout: LayoutFn | None = None,
) -> RankBatch:
    """``layout_micro_batch(...)[rank]``, building the tensors of ``rank`` only."""
    _check_positive("world_size", world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
    arrays, all_pieces = _arrays_and_pieces(docs, world_size, tokens_per_rank, min_piece_tokens, layout)
    return _materialize(arrays, all_pieces, rank, tokens_per_rank, pad_token_id)


def _water_fill(caps: list[int], total: int) -> list[int]:
    """Integer shares summing to ``total``, share_i <= caps[i], as equal as the caps allow.

    Smallest caps first (ties: earlier first), each takes min(cap, ceil(remaining / ranks left));
    the remaining total never exceeds the remaining caps, so the last rank absorbs the rest exactly.
    """
    shares = [0] * len(caps)
    remaining, left = total, len(caps)
    for i in sorted(range(len(caps)), key=lambda i: (caps[i], i)):
        take = min(caps[i], -(-remaining // left))
        shares[i] = take
        remaining -= take
        left -= 1
    if remaining:
        raise AssertionError(f"water filling left {remaining} tokens (caps {caps}, total {total})")
    return shares


def _zigzag(ranks: list[int], shares: list[int], min_piece: int) -> list[tuple[int, int, int]]:
    """(rank, doc_start, length) runs: heads of ranks in order, then their tails in reverse order."""
    heads, tails = [], []
    for share in shares:
        tail = share // 2 if share >= 2 * min_piece else 0
        heads.append(share - tail)
        tails.append(tail)
    runs, pos = [], 0
    for rank, n in zip(ranks, heads):
        runs.append((rank, pos, n))
        pos += n
    for rank, n in reversed(list(zip(ranks, tails))):
        runs.append((rank, pos, n))
        pos += n
    # a rank's head before its tail in local order; empty runs dropped
    runs.sort(key=lambda run: ranks.index(run[0]))
    return [run for run in runs if run[2] > 0]


def _merge_adjacent(pieces: list[Piece]) -> list[Piece]:
    """Join consecutive pieces of one document that are also consecutive in the document."""
    out: list[Piece] = []
    for p in pieces:
        if out and out[-1].doc_id == p.doc_id and out[-1].doc_start + out[-1].length == p.doc_start:
            out[-1] = Piece(p.doc_id, out[-1].doc_start, out[-1].length + p.length)
        else:
            out.append(p)
    return out


def _materialize(
    arrays: list[np.ndarray],
    all_pieces: tuple[tuple[Piece, ...], ...],
    rank: int,
    tokens_per_rank: int,
    pad_token_id: int,
) -> RankBatch:
    num_docs = len(arrays)
    ids = np.empty(tokens_per_rank, dtype=np.int64)
    pos = np.empty(tokens_per_rank, dtype=np.int64)
    labels = np.empty(tokens_per_rank, dtype=np.int64)
    offset = 0
    for doc_id, start, n in all_pieces[rank]:
        end = offset + n
        pos[offset:end] = np.arange(start, start + n)
        if doc_id >= num_docs:  # padding pseudo-document
            ids[offset:end] = pad_token_id
            labels[offset:end] = IGNORE_INDEX
        else:
            tokens = arrays[doc_id]
            ids[offset:end] = tokens[start : start + n]
            # next token of the same document; the document's last token has none
            nxt = tokens[start + 1 : start + n + 1]
            labels[offset : offset + len(nxt)] = nxt
            labels[offset + len(nxt) : end] = IGNORE_INDEX
        offset = end
    if offset != tokens_per_rank:
        raise AssertionError(f"layout bug: rank {rank} holds {offset} tokens, expected {tokens_per_rank}")
    return RankBatch(
        input_ids=torch.from_numpy(ids).unsqueeze(0),
        position_ids=torch.from_numpy(pos).unsqueeze(0),
        shift_labels=torch.from_numpy(labels).unsqueeze(0),
        pieces=all_pieces[rank],
        all_pieces=all_pieces,
        num_targets=int((labels != IGNORE_INDEX).sum()),
        global_num_targets=sum(max(len(a) - 1, 0) for a in arrays),
        rank=rank,
        num_docs=num_docs,
    )


def _as_tokens(doc: Sequence[int], index: int) -> np.ndarray:
    if isinstance(doc, torch.Tensor):
        doc = doc.detach().cpu().numpy()
    arr = np.asarray(doc, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"document {index} must be a 1-D sequence of token ids, got shape {arr.shape}")
    return arr


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
