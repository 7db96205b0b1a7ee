"""The baseline layouts (hf_distca.data.baselines): HF-default packing and WLB-LLM-style balanced packing.

Pure functions: every invariant of the rebatcher's layout (each document tiled once, exactly
tokens_per_rank tokens per rank, padding as each rank's own pseudo-document) plus each baseline's
own placement rule, on hand-computed cases. Exact integer bookkeeping: no tolerances.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from oracle import long_tailed_lengths
from test_data import PROPERTY, causal_work, check_layout, micro_batches

from hf_distca.data.baselines import LAYOUTS, balanced_layout, hf_default_layout
from hf_distca.planning import plan_core_attention
from hf_distca.planning.cost import causal_pairs
from hf_distca.planning.pieces import Piece


@PROPERTY
@given(micro_batches(), st.sampled_from(sorted(LAYOUTS)))
def test_every_layout_keeps_the_rebatcher_invariants(case, name):
    docs, world_size, tokens_per_rank = case
    check_layout(docs, world_size, tokens_per_rank, layout=LAYOUTS[name])


def real(pieces, num_docs):
    return [[p for p in rank if p.doc_id < num_docs] for rank in pieces]


def test_hf_default_packs_in_dataset_order_and_chunks_long_documents():
    lengths = [30, 50, 40, 10, 130, 20]
    got = hf_default_layout(lengths, world_size=4, tokens_per_rank=100)
    # rank 0: docs 0-1 (80); doc 2 (40) does not fit the 20 left: rank 1 takes docs 2-3 (50); doc 4
    # (130 > 100) is two independent chunks: 100 on rank 2, 30 on rank 3, then doc 5
    assert real(got, 6) == [
        [Piece(0, 0, 30), Piece(1, 0, 50)],
        [Piece(2, 0, 40), Piece(3, 0, 10)],
        [Piece(4, 0, 100)],
        [Piece(4, 100, 30), Piece(5, 0, 20)],
    ]
    assert [p for rank in got for p in rank if p.doc_id >= 6] == [
        Piece(6, 0, 20), Piece(7, 0, 50), Piece(9, 0, 50)
    ]  # fmt: skip


def test_hf_default_fills_the_gaps_with_what_sequential_packing_left():
    # 60 + 60 + 60 on 2 x 100: the third document finds no rank in order; it fills the two gaps
    got = hf_default_layout([60, 60, 60], world_size=2, tokens_per_rank=100)
    assert got == [
        (Piece(0, 0, 60), Piece(2, 0, 40)),
        (Piece(1, 0, 60), Piece(2, 40, 20), Piece(4, 0, 20)),
    ]


def test_balanced_splits_a_document_whose_attention_exceeds_a_fair_share():
    # one 400-token document and 16 of 25 tokens on 4 ranks x 200: the long one holds ~99% of the
    # attention, so it is split head/tail over all 4 ranks (k = ceil(pairs / fair share) = 4)
    lengths = [400] + [25] * 16
    got = balanced_layout(lengths, world_size=4, tokens_per_rank=200, linear_pairs_per_token=0.0)
    long_pieces = [[p for p in rank if p.doc_id == 0] for rank in got]
    assert [sum(p.length for p in rank) for rank in long_pieces] == [100] * 4
    # head/tail zigzag with equal shares: chunks j and 7 - j of 50 tokens on rank j, equal causal work
    assert long_pieces[0] == [Piece(0, 0, 50), Piece(0, 350, 50)]
    assert len({causal_work(rank) for rank in long_pieces}) == 1
    # whole short documents fill the rest: every rank holds 4 of them
    assert [len([p for p in rank if 0 < p.doc_id < 17]) for rank in got] == [4] * 4


def test_balanced_layout_of_a_full_micro_batch_balances_attention_alone():
    """When the documents fill every rank's budget, every rank ends with the same tokens, so the per-token
    term cannot tell ranks apart: the layout is the one that balances attention pairs alone, and its
    busiest rank stays near the mean (a rank holding few tokens so far is not cheaper: it must still be
    filled). Long-tailed documents, 32 ranks x 4096."""
    world, tokens = 32, 4096
    lengths, total = [], 0
    for n in long_tailed_lengths(2000, np.random.default_rng(0)):
        n = min(int(n), world * tokens - total)
        if n == 0:
            break
        lengths.append(n)
        total += n
    assert total == world * tokens and max(lengths) > 2 * tokens
    got = balanced_layout(lengths, world_size=world, tokens_per_rank=tokens)
    assert got == balanced_layout(
        lengths, world_size=world, tokens_per_rank=tokens, linear_pairs_per_token=0.0
    )
    pairs = [
        sum(causal_pairs(p.doc_start, p.doc_start + p.length) for p in rank)
        for rank in real(got, len(lengths))
    ]
    assert max(pairs) <= 1.12 * (sum(pairs) / world), max(pairs) / (sum(pairs) / world)  # 1.10


def test_balanced_places_whole_documents_on_the_cheapest_rank():
    # no document exceeds a fair share of attention: longest first, each to the least loaded rank
    got = balanced_layout(
        [50, 40, 30, 30, 20, 20], world_size=2, tokens_per_rank=100, linear_pairs_per_token=1.0
    )
    assert real(got, 6) == [
        [Piece(0, 0, 50), Piece(3, 0, 30), Piece(5, 0, 20)],
        [Piece(1, 0, 40), Piece(2, 0, 30), Piece(4, 0, 20)],
    ]


@pytest.mark.parametrize("world", [2, 8])
def test_balanced_beats_hf_default_and_the_rebatcher_on_skewed_batches(world):
    """Max over ranks of attention pairs (full context): a long-tailed batch where one document
    dominates; the token-only rebatcher (equal tokens, longest first) and HF default leave it on one
    rank. DistCA's default layout is the balanced one."""
    tokens = 4096
    lengths = [3500] + [256] * ((world * tokens - 3500) // 256)
    worst = {}
    for name, layout in LAYOUTS.items():
        pieces = layout(lengths, world_size=world, tokens_per_rank=tokens)
        plan = plan_core_attention(pieces, q_row_bytes=1, kv_row_bytes=1)
        worst[name] = max(plan.load_before)  # every rank's own pieces with their full context
    assert worst["balanced"] < worst["tokens"] and worst["balanced"] < worst["hf-default"]
    assert worst["distca"] == worst["balanced"] and LAYOUTS["distca"] is balanced_layout
    assert worst["hf-default"] >= causal_pairs(0, 3500)


def test_layout_errors():
    for layout in (hf_default_layout, balanced_layout):
        with pytest.raises(ValueError, match="more than world_size x tokens_per_rank"):
            layout([60, 60], world_size=1, tokens_per_rank=100)
        with pytest.raises(ValueError, match="lengths must be >= 0"):
            layout([-1], world_size=1, tokens_per_rank=100)
        with pytest.raises(ValueError, match="world_size must be an int >= 1"):
            layout([1], world_size=0, tokens_per_rank=100)
    with pytest.raises(ValueError, match="linear_pairs_per_token must be >= 0"):
        balanced_layout([1], world_size=1, tokens_per_rank=100, linear_pairs_per_token=-1.0)


def test_balanced_cuts_a_document_inside_one_node_when_nodes_are_known():
    # three 300-token documents (each cut over 3 ranks for its attention) and short ones on 8 ranks x
    # 200 in nodes of 4: without nodes two of them straddle nodes; with ranks_per_node=4 each stays in
    # one node, and the layout keeps the rebatcher's invariants
    lengths = [300, 300, 300] + [25] * 28
    world, tokens = 8, 200

    def holders(pieces, doc):
        return sorted({r for r, rank in enumerate(pieces) for p in rank if p.doc_id == doc})

    plain = balanced_layout(lengths, world_size=world, tokens_per_rank=tokens)
    assert [holders(plain, doc) for doc in range(3)] == [[0, 1, 2], [3, 4, 5], [0, 6, 7]]
    local = balanced_layout(lengths, world_size=world, tokens_per_rank=tokens, ranks_per_node=4)
    assert [holders(local, doc) for doc in range(3)] == [[0, 1, 2], [4, 5, 6], [0, 1, 3]]
    docs = [list(range(n)) for n in lengths]
    check_layout(docs, world, tokens, layout=lambda *a, **k: balanced_layout(*a, **k, ranks_per_node=4))
