"""Inputs that differ between ranks, or are malformed on one rank: every rank raises within seconds.

One spawn of 3 gloo processes runs every case. In each error case one rank (the "odd" one) gets the bad
input. After raising, the odd rank stays alive and joins no collective until every other rank has
reported its own error (through marker files), so the others cannot have been released by the odd rank
exiting or moving on: they must raise from the engine's consistency check, within ``MAX_SECONDS``. The
parent then checks every rank's error type and message (what differs, on which rank). Last, the group is
still usable: a valid call succeeds, the check runs once per layout object (not per layer), and a plan
cache cleared on one rank only changes nothing.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from distributed import mark_or_wait, run_distributed
from oracle import random_qkv

from hf_distca import DistCAConfig, core_attention, metrics
from hf_distca.engine import engine_state

WORLD = 3
ODD = 1  # the rank that gets the bad input
D = 8
MAX_SECONDS = 5.0  # every rank must have raised by then (in practice milliseconds)
WAIT_FOR_OTHERS = 30.0  # how long the odd rank waits, alive, for the others' errors
PIECES = [[(0, 0, 6), (1, 0, 4)], [(1, 4, 10)], [(2, 0, 5), (0, 6, 3)]]
ROWS = [sum(n for _, _, n in p) for p in PIECES]
BASE = DistCAConfig(shard_tokens=4, backend="reference")


def _case(name: str, expect_odd: tuple[str, list[str]], expect_others: tuple[str, list[str]], **odd) -> dict:
    """``odd``: what the odd rank gets instead of the common input (pieces, all_pieces, rows, config,
    dtype, heads, gather: pass no all_pieces)."""
    return {"name": name, "odd": odd, "expect_odd": expect_odd, "expect_others": expect_others}


DIFFERS = "InconsistentInputError"
CASES = [
    _case("rows_vs_pieces", ("ValueError", ["pieces cover 10 tokens but q holds 11"]),
          (DIFFERS, ["rank 1 passed pieces that do not describe its local rows", "cover 10 tokens but its q holds 11"]),
          rows=11, gather=True),
    _case("rows_vs_pieces_all_pieces", ("ValueError", ["pieces cover 10 tokens but q holds 9"]),
          (DIFFERS, ["rank 1 passed pieces that do not describe its local rows", "its q holds 9"]), rows=9),
    _case("own_entry_not_in_all_pieces", ("ValueError", ["all_pieces must list the pieces of all 3 ranks"]),
          (DIFFERS, ["rank 1 passed an all_pieces list that does not match its own pieces"]),
          all_pieces=[PIECES[0], [(1, 4, 9), (9, 0, 1)], PIECES[2]]),
    _case("malformed_piece", ("ValueError", ["a piece is (doc_id, doc_start, length)"]),
          (DIFFERS, ["rank 1 passed pieces that do not describe its local rows"]),
          pieces=[(1, 4)], gather=True),
    _case("all_pieces_differ", (DIFFERS, ["all_pieces differs between ranks", "rank 1) all_pieces entries for rank(s) [0]"]),
          (DIFFERS, ["all_pieces differs between ranks", "agrees with every rank's own pieces"]),
          all_pieces=[[(0, 0, 5), (1, 0, 5)], PIECES[1], PIECES[2]]),
    _case("tolerance", (DIFFERS, ["DistCAConfig.tolerance: None on rank(s) [0, 2]; 0.25 on rank(s) [1]"]),
          (DIFFERS, ["DistCAConfig.tolerance: None on rank(s) [0, 2]; 0.25 on rank(s) [1]"]),
          config={"tolerance": 0.25}),
    _case("shard_tokens", (DIFFERS, ["DistCAConfig.shard_tokens: 4 on rank(s) [0, 2]; 8 on rank(s) [1]"]),
          (DIFFERS, ["DistCAConfig.shard_tokens: 4 on rank(s) [0, 2]; 8 on rank(s) [1]"]),
          config={"shard_tokens": 8}),
    _case("backend", (DIFFERS, ["DistCAConfig.backend: 'reference' on rank(s) [0, 2]; 'auto' on rank(s) [1]"]),
          (DIFFERS, ["DistCAConfig.backend: 'reference' on rank(s) [0, 2]; 'auto' on rank(s) [1]"]),
          config={"backend": "auto"}),
    _case("receive_bound", (DIFFERS, ["DistCAConfig.max_recv_bytes_per_server: None on rank(s) [0, 2]; 4096 on"]),
          (DIFFERS, ["DistCAConfig.max_recv_bytes_per_server: None on rank(s) [0, 2]; 4096 on rank(s) [1]"]),
          config={"max_recv_bytes_per_server": 4096}),
    _case("dtype_gathered", (DIFFERS, ["dtype: torch.float32 on rank(s) [0, 2]; torch.float64 on rank(s) [1]"]),
          (DIFFERS, ["dtype: torch.float32 on rank(s) [0, 2]; torch.float64 on rank(s) [1]"]),
          dtype=torch.float64, gather=True),
    _case("query_heads", (DIFFERS, ["q_heads: 4 on rank(s) [0, 2]; 2 on rank(s) [1]"]),
          (DIFFERS, ["q_heads: 4 on rank(s) [0, 2]; 2 on rank(s) [1]"]), heads=(2, 2)),
    _case("kv_heads", (DIFFERS, ["kv_heads: 2 on rank(s) [0, 2]; 1 on rank(s) [1]"]),
          (DIFFERS, ["kv_heads: 2 on rank(s) [0, 2]; 1 on rank(s) [1]"]), heads=(4, 1)),
]  # fmt: skip


def _call(rank: int, odd: dict, all_pieces_obj) -> torch.Tensor:
    mine = odd if rank == ODD else {}
    hq, hkv = mine.get("heads", (4, 2))
    rows = mine.get("rows", ROWS[rank])
    q, k, v, _ = random_qkv(rows, hq, hkv, D, mine.get("dtype", torch.float32), seed=rank)
    config = DistCAConfig(**{**vars(BASE), **mine.get("config", {})})
    all_pieces = None if odd.get("gather") else mine.get("all_pieces", all_pieces_obj)
    return core_attention(q, k, v, mine.get("pieces", PIECES[rank]), config=config, all_pieces=all_pieces)


def _worker(rank: int, world: int, marker_dir: str) -> list[dict]:
    results = []
    for i, case in enumerate(CASES):
        dist.barrier()
        start = time.perf_counter()
        try:
            _call(rank, case["odd"], [list(p) for p in PIECES])  # a new all_pieces object per case
            results.append({"error": None, "seconds": time.perf_counter() - start})
        except Exception as err:  # noqa: BLE001 - reported to the parent, which asserts on it
            seconds = time.perf_counter() - start
            message = "\n".join([str(err), *getattr(err, "__notes__", [])])  # a note: what one rank can tell
            results.append({"error": type(err).__name__, "message": message, "seconds": seconds})
        mark_or_wait(marker_dir, str(i), rank, world, ODD, WAIT_FOR_OTHERS)
    # the group still works; one check per layout object, however many layers use it
    dist.barrier()
    metrics.reset()
    layout = [list(p) for p in PIECES]
    outs = []
    for layer in range(3):
        if rank == 0 and layer == 2:
            engine_state().reset()  # a plan cache miss on one rank only must not desynchronise anything
        outs.append(_call(rank, {}, layout))
    first = metrics.snapshot(reset=True)
    _call(rank, {}, [list(p) for p in PIECES])  # a new object: checked again
    second = metrics.snapshot(reset=True)
    _call(rank, {"gather": True}, None)  # pieces gathered by the engine: checked in that all-gather
    third = metrics.snapshot(reset=True)
    ok = {
        "same_outputs": all(torch.equal(o, outs[0]) for o in outs),
        "checks": [first.checks, second.checks, third.checks],
        "plans": first.plans,
    }
    return [results, ok]


def test_every_rank_raises_when_inputs_disagree(tmp_path):
    per_rank = run_distributed(_worker, WORLD, str(tmp_path), timeout=180)
    for i, case in enumerate(CASES):
        for rank in range(WORLD):
            res = per_rank[rank][0][i]
            cls, fragments = case["expect_odd"] if rank == ODD else case["expect_others"]
            where = f"{case['name']} rank {rank}: {res}"
            assert res["error"] == cls, where
            for fragment in fragments:
                assert fragment in res["message"], where
            assert res["seconds"] < MAX_SECONDS, where
    for rank in range(WORLD):
        ok = per_rank[rank][1]
        assert ok["same_outputs"], rank
        assert ok["checks"] == [1, 1, 1], (rank, ok)
        assert ok["plans"] == (2 if rank == 0 else 1), (rank, ok)
