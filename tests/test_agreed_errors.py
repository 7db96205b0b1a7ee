"""Errors one rank alone can meet are decided together (issue 31, outcome 4): on 2 gloo processes, one rank
(the "odd" one) gets a bad input, and every rank raises the same error, with the same text, within seconds.

The cases: a plan that differs between ranks from inputs the consistency check passes (another sliding
window on one rank: the plan digests, all-gathered once per new plan, differ); a training step whose batch
differs on one rank (a document fewer, the replay's ``drop_doc``); a padded packed row and a batch of
several rows with a ``distca_layout`` on one rank (found by the attention function, raised by the engine's
check). As in tests/test_engine_consistency.py, the odd rank stays alive and outside any collective after
raising until the others have raised too, so they cannot have been released by it exiting. Last, the
normal path: a valid step after the errors trains, the plans are compared once per new plan (not per
layer), and a plan cache cleared on one rank changes no collective.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from distributed import mark_or_wait, run_distributed
from oracle import random_qkv
from test_engine_remat import docs_of, tiny_llama

from hf_distca import DistCAConfig, core_attention, enable_distca, nano_batch_loss
from hf_distca.data import DistCABatches
from hf_distca.engine import engine_state

WORLD = 2
ODD = 1
MAX_SECONDS = 10.0  # every rank must have raised by then (in practice well under a second)
WAIT_FOR_OTHERS = 60.0
CONFIG = DistCAConfig(shard_tokens=8, backend="reference")
PIECES = [[(0, 0, 6), (1, 0, 4)], [(1, 4, 10), (2, 0, 3)]]
TOKENS_PER_RANK = 48
LENGTHS = [30, 7, 19, 12, 5]

CASES = {
    "plan_window": ("PlanMismatchError", "made different plans of one micro-batch"),
    "drop_doc": ("InconsistentInputError", "all_pieces differs between ranks"),
    "padded_row": ("InconsistentInputError", "rank 1 passed a distca_layout with a padded packed row"),
    "several_rows": ("InconsistentInputError", "rank 1 passed a distca_layout with a batch of several rows"),
}


def _engine_call(rank: int, window: int | None) -> torch.Tensor:
    rows = sum(n for _, _, n in PIECES[rank])
    q, k, v, _ = random_qkv(rows, 4, 2, 8, torch.float32, seed=rank)
    return core_attention(
        q, k, v, PIECES[rank], config=CONFIG, all_pieces=[list(p) for p in PIECES], window=window
    )


def _batch(rank: int, docs: list[list[int]]) -> dict:
    loader = DistCABatches(docs, rank=rank, world_size=WORLD, tokens_per_rank=TOKENS_PER_RANK)
    return loader.micro_batch(docs)


def _step(model, rank: int, odd: str | None) -> None:
    """One training step of the tiny Llama on this rank's share (``odd``: what this rank does wrong)."""
    docs = docs_of(LENGTHS, seed=3)
    batch = _batch(rank, docs[:-1] if odd == "drop_doc" else docs)
    if odd == "padded_row":
        mask = torch.ones_like(batch["input_ids"])
        mask[0, -1] = 0  # (1, T), the last token marked as padding
        batch["attention_mask"] = mask
    elif odd == "several_rows":
        for key in ("input_ids", "position_ids", "labels", "shift_labels"):
            batch[key] = batch[key].repeat(2, 1)  # (2, T)
    n_targets = sum(len(d) - 1 for d in docs)
    nano_batch_loss(model, batch, num_items_in_batch=n_targets).backward()


def _case(model, rank: int, name: str) -> None:
    odd = name if rank == ODD else None
    if name == "plan_window":
        _engine_call(rank, 4 if odd else None)
    else:
        _step(model, rank, odd)


def _worker(rank: int, world: int, marker_dir: str) -> dict:
    model = tiny_llama(seed=7)
    enable_distca(model, group=dist.group.WORLD, config=CONFIG)
    results = {}
    for name in CASES:
        dist.barrier()
        start = time.perf_counter()
        try:
            _case(model, rank, name)
            results[name] = {"error": None}
        except Exception as err:  # noqa: BLE001 - reported to the parent, which asserts on it
            results[name] = {"error": type(err).__name__, "message": str(err)}
        results[name]["seconds"] = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        mark_or_wait(marker_dir, name, rank, world, ODD, WAIT_FOR_OTHERS)
    # the normal path: a step trains; each new plan compared once, whatever the layers and the caches
    dist.barrier()
    state = engine_state()
    before = len(state.compared_plans)
    _step(model, rank, None)
    after_step = len(state.compared_plans)
    if rank == 0:
        state.reset()  # a plan cache cleared on one rank only: no new comparison, no collective skipped
    _step(model, rank, None)  # the same documents, a new layout object: the same plan, compared already
    grads = {n: p.grad.norm().item() for n, p in model.named_parameters() if p.grad is not None}
    results["normal"] = {
        "new_compared": [after_step - before, len(state.compared_plans) - after_step],
        "grads": len(grads),
        "finite": all(g == g for g in grads.values()),
    }
    return results


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    return run_distributed(_worker, WORLD, str(tmp_path_factory.mktemp("markers")), timeout=300)


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_raises_the_same_error(per_rank, name):
    cls, fragment = CASES[name]
    got = [per_rank[r][name] for r in range(WORLD)]
    for rank, res in enumerate(got):
        assert res["error"] == cls, (name, rank, res)
        assert fragment in res["message"], (name, rank, res)
        assert res["seconds"] < MAX_SECONDS, (name, rank, res)
    assert len({res["message"] for res in got}) == 1, (name, got)


def test_the_normal_path_is_unchanged(per_rank):
    for rank in range(WORLD):
        normal = per_rank[rank]["normal"]
        # one plan per step (one window, one nano-batch): compared at its first layer, never again
        assert normal["new_compared"] == [1, 0], (rank, normal)
        assert normal["grads"] > 0 and normal["finite"], (rank, normal)
