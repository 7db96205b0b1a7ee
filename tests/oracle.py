"""Shared test helpers: the single-process attention oracle, random piece layouts, and the tolerance table.

The oracle is deliberately independent of the package: plain per-document causal softmax attention
with an explicit boolean mask, a few lines of torch. Layouts describe which rank holds which run of
which document ("pieces", see hf_distca.planning.pieces) and where each rank's local tokens lie in
the concatenation of all documents (documents in the order of ``doc_ids``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tolerances import TOL  # noqa: F401  (re-exported for the engine tests)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, kind: str, msg: str = "") -> None:
    """torch.testing.assert_close with a tolerance from TOL (dtype of ``actual`` kept)."""
    rtol, atol = TOL[kind]
    torch.testing.assert_close(
        actual, expected.to(actual.dtype), rtol=rtol, atol=atol, msg=lambda m: f"{msg}: {m}" if msg else m
    )


# ----------------------------------------------------------------------------------------------- oracle
def visible(lq: int, lk: int, window: int | None = None) -> torch.Tensor:
    """(lq, lk) bool: query r, the key position r + lk - lq (queries are the last lq positions of the
    keys), sees key j iff 0 <= (r + lk - lq) - j < window (any j <= r + lk - lq when window is None):
    Transformers' ``sliding_window_causal_mask_function`` (kv_idx > q_idx - window, kv_idx <= q_idx),
    filled element by element."""
    mask = torch.zeros(lq, lk, dtype=torch.bool)
    for r in range(lq):
        i = r + lk - lq
        for j in range(lk):
            mask[r, j] = i - j >= 0 and (window is None or i - j < window)
    return mask


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
):
    """One document: q (L, Hq, D), k/v (L, Hkv, D) -> (L, Hq, D); query i sees keys 0..i (with a sliding
    ``window``: keys j with i - j < window). ``softcap``: scores -> softcap * tanh(scores / softcap) (Gemma
    2); ``sinks`` (Hq,): one more softmax column per head whose probability is dropped (gpt-oss).

    GQA: query head h uses key/value head h // (Hq // Hkv) (the repeat_interleave convention of
    Transformers' repeat_kv)."""
    length, hq, d = q.shape
    groups = hq // k.shape[1]
    scale = d**-0.5 if scale is None else scale
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # (Hq, L, L)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    mask = torch.ones(length, length, dtype=torch.bool).tril()  # mask[i, j]: query i may see key j
    if window is not None:
        mask &= ~torch.ones(length, length, dtype=torch.bool).tril(-window)  # and i - j < window
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(hq, 1, 1).expand(hq, length, 1)  # (Hq, L, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # (Hq, L, L)
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def oracle_attention(
    q_all,
    k_all,
    v_all,
    doc_lens: Sequence[int],
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
):
    """Documents concatenated along dim 0 (in the order of ``doc_lens``) -> their outputs, concatenated."""
    outs, start = [], 0
    for n in doc_lens:
        rows = slice(start, start + n)
        outs.append(causal_attention(q_all[rows], k_all[rows], v_all[rows], scale, window, softcap, sinks))
        start += n
    if not outs:
        return q_all[:0] * 0
    return torch.cat(outs)


def oracle_with_grads(
    q_all, k_all, v_all, weights, doc_lens, scale=None, compute_dtype=torch.float64, window=None,
    softcap=None, sinks=None,
):  # fmt: skip
    """Outputs and gradients of loss = sum(out * weights), all computed in ``compute_dtype``: (out, dq, dk,
    dv), and the sinks' gradient last when ``sinks`` are given."""
    leaves = [t.detach().to(compute_dtype).requires_grad_(True) for t in (q_all, k_all, v_all)]
    if sinks is not None:
        leaves.append(sinks.detach().to(compute_dtype).requires_grad_(True))
    out = oracle_attention(*leaves[:3], doc_lens, scale, window, softcap, *leaves[3:])
    (out * weights.to(compute_dtype)).sum().backward()
    return out.detach(), *(t.grad for t in leaves)


def random_qkv(total: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int):
    """Global q, k, v and loss weights, identical in every process that uses the same seed."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(total, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(total, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(total, hkv, d, generator=g, dtype=torch.float64)
    w = torch.randn(total, hq, d, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype), w.to(dtype)


# ---------------------------------------------------------------------------------------------- layouts
@dataclass
class Layout:
    """Documents (ids and lengths, in concatenation order) and which rank holds which piece."""

    name: str
    doc_ids: list[int]
    doc_lens: list[int]
    pieces: list[list[tuple[int, int, int]]]
    """Per rank, (doc_id, doc_start, length) in local order."""

    @property
    def world(self) -> int:
        return len(self.pieces)

    @property
    def total(self) -> int:
        return sum(self.doc_lens)

    def offsets(self) -> dict[int, int]:
        """doc_id -> first row of the document in the concatenated global tensors."""
        out, start = {}, 0
        for doc, n in zip(self.doc_ids, self.doc_lens):
            out[doc] = start
            start += n
        return out

    def rows(self, rank: int) -> np.ndarray:
        """Global row of each of ``rank``'s local tokens, in local order."""
        off = self.offsets()
        parts = [np.arange(off[d] + s, off[d] + s + n, dtype=np.int64) for d, s, n in self.pieces[rank]]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def labels(self, rank: int) -> list[tuple[int, int]]:
        """(doc_id, position) of each of ``rank``'s local tokens, in local order."""
        return [(d, p) for d, s, n in self.pieces[rank] for p in range(s, s + n)]

    def check(self) -> None:
        """The pieces tile every document exactly once (a self-check of the generators)."""
        seen = np.concatenate([self.rows(r) for r in range(self.world)] or [np.zeros(0, dtype=np.int64)])
        assert sorted(seen.tolist()) == list(range(self.total)), (
            f"{self.name}: pieces do not tile the documents"
        )


def cut_points(length: int, parts: int, rng: random.Random) -> list[tuple[int, int]]:
    """Split [0, length) into ``parts`` non-empty runs at random points: [(start, len), ...]."""
    parts = max(1, min(parts, length))
    cuts = sorted(rng.sample(range(1, length), parts - 1)) if parts > 1 else []
    bounds = [0, *cuts, length]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:])]


def scatter(
    name: str,
    doc_lens: Sequence[int],
    world: int,
    rng: random.Random,
    *,
    doc_ids: Sequence[int] | None = None,
    max_pieces: int = 4,
    spread: tuple[int, int] = (1, 4),
    empty_ranks: Sequence[int] = (),
    shuffle_local: bool = True,
) -> Layout:
    """Cut every document into 1..max_pieces runs and scatter them over ``spread`` distinct ranks
    (never the ``empty_ranks``); every rank's local order is then shuffled."""
    doc_ids = list(doc_ids) if doc_ids is not None else list(range(len(doc_lens)))
    usable = [r for r in range(world) if r not in set(empty_ranks)]
    per_rank: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    for doc, length in zip(doc_ids, doc_lens):
        runs = cut_points(length, rng.randint(1, max_pieces), rng)
        n_ranks = min(rng.randint(*spread), len(runs), len(usable))
        ranks = rng.sample(usable, n_ranks)
        owners = ranks + [rng.choice(ranks) for _ in range(len(runs) - n_ranks)]
        rng.shuffle(owners)
        for (start, n), r in zip(runs, owners):
            per_rank[r].append((doc, start, n))
    if shuffle_local:
        for pieces in per_rank:
            rng.shuffle(pieces)
    layout = Layout(name, doc_ids, list(doc_lens), per_rank)
    layout.check()
    return layout


def pack_sequential(doc_lens: Sequence[int], world: int, tokens_per_rank: int | None = None):
    """The rebatcher's simplest layout: documents back to back, cut into ``world`` equal runs of
    tokens (the last rank may get fewer). Returns per-rank pieces."""
    total = int(sum(doc_lens))
    per = tokens_per_rank or -(-total // world)
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    rank, used = 0, 0
    for doc, length in enumerate(doc_lens):
        start = 0
        while start < length:
            if rank >= world:
                raise ValueError(f"{total} tokens do not fit in {world} x {per}")
            n = min(length - start, per - used)
            out[rank].append((doc, start, n))
            start += n
            used += n
            if used == per:
                rank, used = rank + 1, 0
    return out


def long_tailed_lengths(
    n: int, rng: np.random.Generator, *, median: float = 1500, sigma: float = 1.3, lo=16, hi=131072
):
    """Log-normal document lengths (long tail), clipped to [lo, hi]."""
    return np.clip(rng.lognormal(np.log(median), sigma, n).astype(np.int64), lo, hi).tolist()


def named_layouts(world: int, seed: int) -> list[Layout]:
    """The layout zoo of the engine tests (small documents; use shard_tokens 8 or 16 so they get cut)."""
    rng = random.Random(seed * 1000 + world)
    out = []
    # random lengths and placements; ids not contiguous
    lens = [rng.randint(1, 90) for _ in range(7)]
    out.append(scatter("random", lens, world, rng, doc_ids=[3 * i + 5 for i in range(7)]))
    # every document spans 2..4 ranks
    lens = [rng.randint(30, 120) for _ in range(5)]
    out.append(scatter("spans", lens, world, rng, max_pieces=4, spread=(min(2, world), min(4, world))))
    # one rank holds no token at all
    lens = [rng.randint(5, 150) for _ in range(5)]
    out.append(scatter("empty_rank", lens, world, rng, empty_ranks=[world - 1]))
    # all documents short, odd lengths (1, 3, 5, 7)
    lens = [1, 1, 3] + [rng.choice([1, 3, 5, 7]) for _ in range(12)]
    out.append(scatter("short", lens, world, rng, max_pieces=2))
    # one giant document held by rank 0 only, plus short ones elsewhere: forces moves
    giant = 256 + 9
    small = [rng.randint(1, 24) | 1 for _ in range(6)]
    per_rank: list[list[tuple[int, int, int]]] = [[(0, 0, giant)]] + [[] for _ in range(world - 1)]
    for i, n in enumerate(small):
        per_rank[1 + i % (world - 1)].append((i + 1, 0, n))
    out.append(Layout("giant", list(range(7)), [giant, *small], per_rank))
    # pieces of one document on non-adjacent ranks and non-adjacent within one rank's local order
    if world >= 3:
        # doc 0: [0,40) on rank 0, [40,70) on rank 2, [70,101) on rank 0 again; rank 1 only other docs
        per_rank = [[(0, 0, 40), (1, 0, 33), (0, 70, 31)], [(2, 0, 57)], [(1, 33, 20), (0, 40, 30)]]
        per_rank += [[(3 + r, 0, 11 + 2 * r)] for r in range(world - 3)]
        lens = [101, 53, 57] + [11 + 2 * r for r in range(world - 3)]
    else:
        per_rank = [[(0, 0, 40), (1, 0, 33), (0, 70, 31), (2, 10, 7)], [(0, 40, 30), (2, 0, 10), (1, 33, 20)]]
        lens = [101, 53, 17]
    out.append(Layout("nonadjacent", list(range(len(lens))), lens, per_rank))
    # the realistic case: long-tailed lengths packed back to back with equal tokens per rank
    lens = long_tailed_lengths(12, np.random.default_rng(seed), median=40, sigma=1.0, lo=1, hi=300)
    out.append(Layout("packed", list(range(len(lens))), lens, pack_sequential(lens, world)))
    for layout in out:
        layout.check()
    return out
