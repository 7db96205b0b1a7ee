"""Tests of the data path: global batch planning, layout over ranks, synthetic documents.

Everything here is exact integer bookkeeping: every comparison is exact (no tolerances).
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_distca.data import (
    IGNORE_INDEX,
    GlobalBatchPlan,
    RankBatch,
    document_lengths,
    generate_documents,
    generate_text_documents,
    layout_for_rank,
    layout_micro_batch,
    layout_pieces,
    plan_global_batches,
)
from hf_distca.planning.pieces import DocIndex

PROPERTY = settings(max_examples=150, deadline=None)


# ---------------------------------------------------------------- helpers (independent of the code under test)


def rebuild(batches: list[RankBatch], num_docs: int):
    """Rebuild every document from the ranks' tensors using only the pieces.

    Returns (tokens, positions, labels, coverage) per real document, and the padding tokens seen.
    Each position's coverage counts how many pieces of all ranks hold it.
    """
    lengths: dict[int, int] = {}
    for b in batches:
        for doc_id, start, n in b.pieces:
            lengths[doc_id] = max(lengths.get(doc_id, 0), start + n)
    out = {
        d: (np.full(n, -1), np.full(n, -1), np.full(n, -7), np.zeros(n, dtype=int))
        for d, n in lengths.items()
    }
    for b in batches:
        ids, pos, lab = (t[0].numpy() for t in (b.input_ids, b.position_ids, b.shift_labels))
        offset = 0
        for doc_id, start, n in b.pieces:
            tok, p, lb, cov = out[doc_id]
            tok[start : start + n] = ids[offset : offset + n]
            p[start : start + n] = pos[offset : offset + n]
            lb[start : start + n] = lab[offset : offset + n]
            cov[start : start + n] += 1
            offset += n
        assert offset == b.input_ids.shape[1]
    return out


def check_layout(
    docs: list[list[int]], world_size: int, tokens_per_rank: int, pad: int = 0, layout=None
) -> list[RankBatch]:
    batches = layout_micro_batch(
        docs, world_size=world_size, tokens_per_rank=tokens_per_rank, pad_token_id=pad, layout=layout
    )
    assert len(batches) == world_size
    all_pieces = tuple(b.pieces for b in batches)
    for r, b in enumerate(batches):
        assert b.rank == r and b.num_docs == len(docs)
        for t in (b.input_ids, b.position_ids, b.shift_labels):
            assert t.shape == (1, tokens_per_rank) and t.dtype == torch.long
        assert sum(n for _, _, n in b.pieces) == tokens_per_rank
        assert all(n > 0 for _, _, n in b.pieces)
        assert b.all_pieces == all_pieces
        assert b.num_targets == int((b.shift_labels != IGNORE_INDEX).sum())
        assert b.global_num_targets == sum(max(len(d) - 1, 0) for d in docs)
    assert sum(b.num_targets for b in batches) == sum(max(len(d) - 1, 0) for d in docs)

    rebuilt = rebuild(batches, len(docs))
    for d, doc in enumerate(docs):
        if not doc:
            assert d not in rebuilt
            continue
        tok, pos, lab, cov = rebuilt[d]
        assert len(tok) == len(doc)
        assert (cov == 1).all(), f"doc {d}: coverage {cov.tolist()}"
        assert tok.tolist() == list(doc)
        assert pos.tolist() == list(range(len(doc)))
        assert lab.tolist() == list(doc[1:]) + [IGNORE_INDEX]
    # padding: rank r's own pseudo-document, only the unavoidable remainder
    pad_total = 0
    for r, b in enumerate(batches):
        pad_pieces = [p for p in b.pieces if p.doc_id >= len(docs)]
        assert all(p.doc_id == len(docs) + r and p.doc_start == 0 for p in pad_pieces)
        assert len(pad_pieces) <= 1
        if pad_pieces:
            tok, pos, lab, cov = rebuilt[len(docs) + r]
            assert (
                (tok == pad).all() and pos.tolist() == list(range(len(tok))) and (lab == IGNORE_INDEX).all()
            )
            pad_total += len(tok)
    assert pad_total == world_size * tokens_per_rank - sum(len(d) for d in docs)
    # the shared planning index accepts the pieces and agrees on document lengths
    index = DocIndex(all_pieces)
    assert index.tokens_per_rank == [tokens_per_rank] * world_size
    for d, doc in enumerate(docs):
        if doc:
            assert index.doc_length[d] == len(doc)
    return batches


def causal_work(pieces) -> int:
    """sum over held tokens of (position + 1): causal attention pairs of the rank's queries."""
    return sum((s + 1 + s + n) * n // 2 for _, s, n in pieces)


@st.composite
def micro_batches(draw):
    world_size = draw(st.integers(1, 5))
    tokens_per_rank = draw(st.integers(1, 40))
    capacity = world_size * tokens_per_rank
    lengths = draw(st.lists(st.integers(0, 3 * tokens_per_rank), max_size=12))
    # keep a prefix that fits the capacity
    kept, total = [], 0
    for n in lengths:
        if total + n <= capacity:
            kept.append(n)
            total += n
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, 50, size=n).tolist() for n in kept]
    return docs, world_size, tokens_per_rank


# ---------------------------------------------------------------- layout_micro_batch


@PROPERTY
@given(micro_batches(), st.integers(-5, 5))
def test_layout_invariants(case, pad):
    docs, world_size, tokens_per_rank = case
    check_layout(docs, world_size, tokens_per_rank, pad)


@PROPERTY
@given(micro_batches())
def test_layout_is_deterministic_and_for_rank_agrees(case):
    docs, world_size, tokens_per_rank = case
    a = layout_micro_batch(docs, world_size=world_size, tokens_per_rank=tokens_per_rank)
    b = layout_micro_batch([list(d) for d in docs], world_size=world_size, tokens_per_rank=tokens_per_rank)
    rank = len(docs) % world_size
    c = layout_for_rank(docs, rank=rank, world_size=world_size, tokens_per_rank=tokens_per_rank)
    for x, y in zip(a, b):
        assert x.pieces == y.pieces
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.shift_labels, y.shift_labels)
        assert torch.equal(x.position_ids, y.position_ids)
    assert c.pieces == a[rank].pieces and c.all_pieces == a[rank].all_pieces
    assert torch.equal(c.input_ids, a[rank].input_ids) and torch.equal(c.shift_labels, a[rank].shift_labels)


@PROPERTY
@given(st.integers(1, 5), st.integers(1, 40), st.lists(st.integers(1, 40), max_size=12))
def test_no_split_when_everything_fits_whole(world_size, tokens_per_rank, lengths):
    # largest-first to the rank with most free space always succeeds when
    # total <= W*T - (W-1)*max_len: the most free rank then has >= the doc's length free
    lengths = [n for n in lengths if n <= tokens_per_rank]
    while lengths and sum(lengths) > world_size * tokens_per_rank - (world_size - 1) * max(lengths):
        lengths.pop()
    pieces = layout_pieces(lengths, world_size=world_size, tokens_per_rank=tokens_per_rank)
    real = [p for rank in pieces for p in rank if p.doc_id < len(lengths)]
    assert sorted(real) == sorted((d, 0, n) for d, n in enumerate(lengths))


def test_whole_documents_largest_first_to_most_free_rank():
    pieces = layout_pieces([3, 5, 2, 5, 1], world_size=2, tokens_per_rank=8)
    # order 5(doc1)->r0, 5(doc3)->r1, 3(doc0)->r0 (tie 3/3: lower rank), 2(doc2)->r1, 1(doc4)->r1 (free 0 vs 1)
    assert pieces == [((1, 0, 5), (0, 0, 3)), ((3, 0, 5), (2, 0, 2), (4, 0, 1))]


def test_zigzag_of_a_document_longer_than_tokens_per_rank():
    doc = list(range(100, 132))  # 32 tokens over 4 ranks of 8: 2k = 8 chunks of 4
    batches = check_layout([doc], world_size=4, tokens_per_rank=8)
    pieces = [b.pieces for b in batches]
    # rank j holds chunks j and 7-j; the middle rank's two chunks are adjacent, hence one piece
    assert pieces == [
        ((0, 0, 4), (0, 28, 4)),
        ((0, 4, 4), (0, 24, 4)),
        ((0, 8, 4), (0, 20, 4)),
        ((0, 12, 8),),
    ]
    assert [causal_work(p) for p in pieces] == [132, 132, 132, 132]
    assert batches[1].input_ids.tolist() == [[104, 105, 106, 107, 124, 125, 126, 127]]
    assert batches[1].position_ids.tolist() == [[4, 5, 6, 7, 24, 25, 26, 27]]
    # the label of a piece's last token is the first token of the next chunk (no target lost at a cut)
    assert batches[1].shift_labels.tolist() == [[105, 106, 107, 108, 125, 126, 127, 128]]
    assert batches[0].shift_labels.tolist() == [[101, 102, 103, 104, 129, 130, 131, IGNORE_INDEX]]


def test_zigzag_balances_causal_work_better_than_contiguous():
    # 2 ranks, one 4T document: contiguous halves would do 1:3 causal work, zigzag does 1:1
    pieces = layout_pieces([64], world_size=2, tokens_per_rank=32)
    assert pieces == [((0, 0, 16), (0, 48, 16)), ((0, 16, 32),)]
    assert causal_work(pieces[0]) == causal_work(pieces[1]) == 1040


def test_cut_document_uses_fewest_ranks_then_whole_documents_fill_the_rest():
    docs = [[7] * 2, [8] * 12, [9] * 2]
    batches = check_layout(docs, world_size=2, tokens_per_rank=8)
    # 12 > 8: cut over 2 ranks, 6 each: r0 = head [0,3) + tail [9,12), r1 = middle [3,9)
    assert [b.pieces for b in batches] == [((1, 0, 3), (1, 9, 3), (0, 0, 2)), ((1, 3, 6), (2, 0, 2))]
    pieces = layout_pieces([12], world_size=4, tokens_per_rank=8)
    assert pieces[2:] == [((3, 0, 8),), ((4, 0, 8),)]  # ranks 2, 3 untouched: only padding (ids 1 + rank)


def test_padding_is_each_ranks_own_pseudo_document():
    batches = check_layout([[11, 12, 13, 14, 15]], world_size=2, tokens_per_rank=4, pad=0)
    # shares 3 / 2: r0 = [0,2) + [4,5), r1 = [2,4); padding doc ids 1 + rank
    assert [b.pieces for b in batches] == [((0, 0, 2), (0, 4, 1), (1, 0, 1)), ((0, 2, 2), (2, 0, 2))]
    assert batches[0].input_ids.tolist() == [[11, 12, 15, 0]]
    assert batches[0].position_ids.tolist() == [[0, 1, 4, 0]]
    assert batches[0].shift_labels.tolist() == [[12, 13, IGNORE_INDEX, IGNORE_INDEX]]
    assert batches[1].input_ids.tolist() == [[13, 14, 0, 0]]
    assert batches[1].position_ids.tolist() == [[2, 3, 0, 1]]
    assert batches[1].shift_labels.tolist() == [[14, 15, IGNORE_INDEX, IGNORE_INDEX]]
    assert [b.num_targets for b in batches] == [2, 2]
    assert batches[0].global_num_targets == 4


def test_min_piece_tokens_keeps_short_shares_in_one_piece():
    # 10 -> r0 (3 free), 8 -> r1 (5 free); 7 is cut over r1, r0 with shares 4 / 3 (r0's cap is 3)
    lengths = [10, 8, 7]
    default = layout_pieces(lengths, world_size=2, tokens_per_rank=13)
    # heads r1 [0,2), r0 [2,4); tails r0 [4,5), r1 [5,7): r0's head and tail are adjacent -> one piece
    assert default == [((0, 0, 10), (2, 2, 3)), ((1, 0, 8), (2, 0, 2), (2, 5, 2), (4, 0, 1))]
    coarse = layout_pieces(lengths, world_size=2, tokens_per_rank=13, min_piece_tokens=3)
    # shares below 2 x 3 are not halved: r1 [0,4), r0 [4,7)
    assert coarse == [((0, 0, 10), (2, 4, 3)), ((1, 0, 8), (2, 0, 4), (4, 0, 1))]


def test_empty_and_single_token_documents():
    docs = [[], [5], [6, 7], []]
    batches = check_layout(docs, world_size=2, tokens_per_rank=2)
    assert [b.num_targets for b in batches] == [1, 0]
    assert batches[0].global_num_targets == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0, "tokens_per_rank": 4}, "world_size must be an int >= 1, got 0"),
        ({"world_size": 2, "tokens_per_rank": 0}, "tokens_per_rank must be an int >= 1, got 0"),
        ({"world_size": 2, "tokens_per_rank": 2}, r"hold 5 tokens, more than .* = 2 x 2 = 4"),
        ({"world_size": 2, "tokens_per_rank": 4, "min_piece_tokens": 0}, "min_piece_tokens"),
    ],
)
def test_layout_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        layout_micro_batch([[1, 2, 3], [4, 5]], **kwargs)


def test_layout_rejects_bad_rank_and_2d_documents():
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, world_size=2\), got 2"):
        layout_for_rank([[1, 2]], rank=2, world_size=2, tokens_per_rank=4)
    with pytest.raises(ValueError, match=r"document 1 must be a 1-D .* shape \(1, 2\)"):
        layout_micro_batch([[1], [[1, 2]]], world_size=1, tokens_per_rank=4)


def test_layout_accepts_tensors():
    docs = [torch.arange(1, 6), torch.arange(10, 13)]
    (b,) = layout_micro_batch(docs, world_size=1, tokens_per_rank=9, pad_token_id=3)
    assert b.input_ids.tolist() == [[1, 2, 3, 4, 5, 10, 11, 12, 3]]
    assert b.pieces == ((0, 0, 5), (1, 0, 3), (2, 0, 1))


# ---------------------------------------------------------------- plan_global_batches


def sizes_of(plan, lengths):
    return [[sum(min(lengths[i], plan.micro_batch_tokens) for i in mb) for mb in step] for step in plan]


@PROPERTY
@given(
    st.lists(st.integers(0, 120), min_size=1, max_size=80),
    st.integers(1, 4),
    st.integers(2, 64),
    st.integers(0, 1000),
    st.integers(0, 3),
    st.booleans(),
)
def test_plan_invariants(lengths, micro, budget, seed, epoch, drop_last):
    try:
        plan = plan_global_batches(
            lengths,
            tokens_per_step=micro * budget,
            micro_batches=micro,
            seed=seed,
            epoch=epoch,
            drop_last=drop_last,
        )
    except ValueError as err:  # only when nothing trainable is left
        assert "shorter than 2 tokens" in str(err) or "fills only" in str(err)
        assert all(n < 2 for n in lengths) or drop_last
        return
    assert isinstance(plan, GlobalBatchPlan) and isinstance(plan, list)
    assert plan.micro_batch_tokens == budget
    used = [i for step in plan for mb in step for i in mb]
    assert len(used) == len(set(used))
    assert sorted(used + list(plan.skipped) + list(plan.dropped)) == list(range(len(lengths)))
    assert list(plan.skipped) == [i for i, n in enumerate(lengths) if n < 2]
    assert list(plan.truncated) == [i for i, n in enumerate(lengths) if n > budget]
    if not drop_last:
        assert plan.dropped == ()
    for k, step in enumerate(plan):
        assert all(mb for mb in step)
        if drop_last or k < len(plan) - 1:
            assert len(step) == micro
        else:
            assert 1 <= len(step) <= micro
    assert all(s <= budget for step in sizes_of(plan, lengths) for s in step)
    assert plan.planned_tokens == sum(s for step in sizes_of(plan, lengths) for s in step)
    # steps consume consecutive runs of the documented shuffle, short documents left out
    order = np.random.Generator(np.random.PCG64(seed + epoch)).permutation(len(lengths))
    order = [int(i) for i in order if lengths[i] >= 2]
    pos = 0
    for step in plan:
        ids = sorted(i for mb in step for i in mb)
        assert ids == sorted(order[pos : pos + len(ids)])
        pos += len(ids)


def test_plan_is_independent_of_world_size_and_so_is_the_data():
    """1 rank with 2T tokens and 2 ranks with T tokens train on identical data."""
    lengths = document_lengths(300, seed=3, mean_length=40, max_length=200, min_length=1)
    rng = np.random.default_rng(0)
    dataset = [rng.integers(1, 100, size=n).tolist() for n in lengths]
    t, micro = 64, 3
    plans = {
        (w, tpr): plan_global_batches(lengths, tokens_per_step=micro * w * tpr, micro_batches=micro, seed=5)
        for w, tpr in [(1, 2 * t), (2, t), (4, t // 2)]
    }
    reference = plans[(1, 2 * t)]
    assert len(reference) >= 10 and reference.truncated  # a non-trivial case: cuts and truncation
    for plan in plans.values():
        assert plan == reference and plan.truncated == reference.truncated

    def real_triples(world_size: int, tokens_per_rank: int, step: int) -> Counter:
        """(micro-batch, doc, token, position, label) of every real token of one step, over all ranks."""
        out = Counter()
        for m, mb in enumerate(reference[step]):
            docs = [dataset[i][: reference.micro_batch_tokens] for i in mb]
            for b in layout_micro_batch(docs, world_size=world_size, tokens_per_rank=tokens_per_rank):
                ids, pos, lab = (x[0].tolist() for x in (b.input_ids, b.position_ids, b.shift_labels))
                owners = [doc_id for doc_id, _, n in b.pieces for _ in range(n)]
                out.update((m, d, *x) for d, *x in zip(owners, ids, pos, lab) if d < len(docs))
        return out

    for step in (0, len(reference) - 1):
        one = real_triples(1, 2 * t, step)
        assert one == real_triples(2, t, step) == real_triples(4, t // 2, step)
        targets = sum(v for k, v in one.items() if k[-1] != IGNORE_INDEX)
        assert targets == sum(min(lengths[i], 2 * t) - 1 for mb in reference[step] for i in mb)
    # the case is non-trivial: on 4 ranks some documents of those steps are cut into pieces
    cut = 0
    for step in (0, len(reference) - 1):
        for mb in reference[step]:
            pieces = layout_pieces([min(lengths[i], 2 * t) for i in mb], world_size=4, tokens_per_rank=t // 2)
            cut += sum(c > 1 for c in Counter(p.doc_id for rank in pieces for p in rank).values())
    assert cut >= 3


def test_plan_known_packing():
    # every document is half a micro-batch: 2 per micro-batch, 4 per step; 10 docs -> 2 steps, 2 dropped
    plan = plan_global_batches([5] * 10, tokens_per_step=20, micro_batches=2, seed=1)
    assert [[len(mb) for mb in step] for step in plan] == [[2, 2], [2, 2]]
    assert len(plan.dropped) == 2 and plan.fill_fraction == 1.0
    kept = plan_global_batches([5] * 10, tokens_per_step=20, micro_batches=2, seed=1, drop_last=False)
    assert [[len(mb) for mb in step] for step in kept] == [[2, 2], [2, 2], [2]]
    assert kept.steps[:2] == plan.steps and kept.dropped == ()


def test_plan_first_fit_within_a_step():
    # budget 10, 2 micro-batches: the 3-token doc fills the gap left in micro-batch 0
    lengths = [7, 6, 3, 9]
    seed = next(s for s in range(100) if np.random.default_rng(s).permutation(4).tolist() == [0, 1, 2, 3])
    plan = plan_global_batches(lengths, tokens_per_step=20, micro_batches=2, seed=seed, drop_last=False)
    assert plan == [[[0, 2], [1]], [[3]]]


def test_plan_determinism_and_epochs():
    lengths = document_lengths(500, seed=0, mean_length=30, max_length=100, min_length=2)
    a = plan_global_batches(lengths, tokens_per_step=200, micro_batches=2, seed=7, epoch=1)
    b = plan_global_batches(lengths.tolist(), tokens_per_step=200, micro_batches=2, seed=7, epoch=1)
    c = plan_global_batches(lengths, tokens_per_step=200, micro_batches=2, seed=7, epoch=2)
    assert a == b and a.dropped == b.dropped
    assert a != c
    assert 0.8 < a.fill_fraction <= 1.0


def test_plan_reports_truncation_and_skips(caplog):
    with caplog.at_level(logging.WARNING, logger="hf_distca.data.sampler"):
        plan = plan_global_batches(
            [50, 1, 0, 4, 8], tokens_per_step=16, micro_batches=2, seed=0, drop_last=False
        )
    assert plan.truncated == (0,) and plan.skipped == (1, 2)
    assert "1 document(s) are longer than the micro-batch budget of 8 tokens" in caplog.text
    assert sorted(i for step in plan for mb in step for i in mb) == [0, 3, 4]
    assert plan.planned_tokens == 8 + 4 + 8


@pytest.mark.parametrize(
    ("lengths", "kwargs", "message"),
    [
        ([], {}, "non-empty"),
        (
            [4],
            {"tokens_per_step": 3, "micro_batches": 2},
            r"3 // 2 = 1 leaves no room.*raise tokens_per_step",
        ),
        ([4], {"micro_batches": 0}, "micro_batches must be an int >= 1, got 0"),
        ([1, 0], {}, "all 2 documents are shorter than 2 tokens"),
        ([4, -1], {}, "document 1 has negative length -1"),
        ([4, 4], {"micro_batches": 4}, r"fills only 1 of the 4 micro-batches.*drop_last=False"),
        ([4], {"seed": -1}, "seed must be an int >= 0, got -1"),
    ],
)
def test_plan_errors(lengths, kwargs, message):
    args = {"tokens_per_step": 64, "micro_batches": 1, "seed": 0} | kwargs
    with pytest.raises(ValueError, match=message):
        plan_global_batches(lengths, **args)


# ---------------------------------------------------------------- synthetic data


def test_generate_documents_shape_determinism_and_range():
    kw = {"vocab_size": 50, "mean_length": 64, "max_length": 1024, "min_length": 16}
    a = generate_documents(400, seed=1, **kw)
    assert a == generate_documents(400, seed=1, **kw)
    assert a != generate_documents(400, seed=2, **kw)
    lengths = np.array([len(d) for d in a])
    assert lengths.min() >= 16 and lengths.max() <= 1024
    assert 45 < lengths.mean() < 85  # lognormal mean ~64 before clipping
    assert np.median(lengths) < lengths.mean() and lengths.max() > 4 * np.median(lengths)  # long tail
    tokens = np.concatenate([np.asarray(d) for d in a])
    assert tokens.min() >= 1 and tokens.max() <= 49 and len(np.unique(tokens)) == 49


def test_generated_tokens_are_predictable_from_the_previous_one():
    # the shared structure: bigram entropy far below uniform, identical across seeds
    def bigram_entropy(docs, vocab):
        counts = np.zeros((vocab, vocab))
        for d in docs:
            np.add.at(counts, (d[:-1], d[1:]), 1)
        rows = counts.sum(1, keepdims=True)
        p = counts / np.maximum(rows, 1)
        with np.errstate(divide="ignore", invalid="ignore"):
            h = -np.nansum(np.where(p > 0, p * np.log(p), 0), axis=1)
        return float((h * rows[:, 0]).sum() / rows.sum())

    vocab = 64
    a = generate_documents(300, vocab_size=vocab, seed=0, mean_length=128, max_length=512)
    b = generate_documents(300, vocab_size=vocab, seed=1, mean_length=128, max_length=512)
    assert bigram_entropy(a, vocab) < 1.6 < np.log(vocab - 1)
    assert bigram_entropy(a + b, vocab) < 1.6  # same language for another seed


def test_generate_text_documents():
    a = generate_text_documents(200, seed=0, mean_words=40, max_words=400, min_words=8, num_words=300)
    assert a == generate_text_documents(200, seed=0, mean_words=40, max_words=400, min_words=8, num_words=300)
    words = [len(d.split()) for d in a]
    assert min(words) >= 8 and max(words) <= 400 and 28 < np.mean(words) < 55
    assert all(d.endswith(".") for d in a)
    vocabulary = {w.rstrip(".") for d in a for w in d.split()}
    assert 250 < len(vocabulary) <= 300 and all(w.isalpha() and w.islower() for w in vocabulary)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vocab_size": 1}, "vocab_size must be an int >= 2"),
        ({"vocab_size": 10, "min_length": 100, "mean_length": 50}, "min=100, mean=50, max=8192"),
        ({"vocab_size": 10, "length_sigma": 0.0}, "length_sigma must be > 0"),
    ],
)
def test_generate_documents_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate_documents(3, seed=0, **kwargs)
