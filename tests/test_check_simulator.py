"""benchmarks/check_simulator.py: it rebuilds the micro-batches bench_remat trained and reads its tables.

CPU only, no processes. The rebuild is the benchmarks' own build_batches (benchmarks/common.py) on the CPU; what the check relies
on is that every rank's copy carries every rank's pieces (it reads rank 0's) and that those pieces are the
tokens each rank trained. The committed 2-GPU measurement pins the whole chain: the plans rebuilt from
the table's own command send exactly the bytes the GPU run counted and have its imbalance.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import check_simulator as cs  # noqa: E402
import common  # noqa: E402
import simulate as sim  # noqa: E402

from hf_distca.data.baselines import LAYOUTS  # noqa: E402

FIXTURE = """# Title

## Checkpointing modes, 2 x NVIDIA H200, llama3-8b-shaped (8 layers)

Command: `NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/bench_remat.py --layout tokens --layers 4 \
--doc-lengths mix --doc-lengths prolong=.gpu_data/doclens_prolong.json --seed 3 --steps 5 --out OUT/x.md`

| sample (tokens in docs >= 16K) | mode | step time (s) | speed-up | peak memory (GiB) | kernels | sent (GiB) | imbalance before -> after |
|---|---|---|---|---|---|---|---|
| mix (57%) | remat | 5.962 | 1.16x | 34.3 | 8 | 4.55 | 1.00 -> 1.00 |
| mix (57%) | none | out of memory | | | | | |
| mix | core-attention forward alone, all layers | 1.002 | recompute - remat = 0.972 s | | | | |
| prolong (17%) | remat (cudnn) | 2.828 | 1.01x | 44.6 | 8 | 3.38 | 1.04 -> 1.02 |

## Consistency check cost, 2 x NVIDIA H200, NCCL

Command: `torchrun --nproc-per-node 2 benchmarks/bench_consistency.py --out OUT/c.md`

| layout | pieces per rank (max) | new layout, check on |
|---|---|---|
| sample (42 documents) | 23 | 0.270 |

## Checkpointing modes, 1 x NVIDIA H200, llama3-8b-shaped (8 layers)

Command: `torchrun --nproc-per-node 1 benchmarks/bench_remat.py --layers 8 --out OUT/y.md`

| sample (tokens in docs >= 16K) | mode | step time (s) | speed-up | peak memory (GiB) | kernels | sent (GiB) | imbalance before -> after |
|---|---|---|---|---|---|---|---|
| prolong (0%) | recompute | 2.678 | 1.00x | 26.7 | 16 | 0.00 | 1.00 -> 1.00 |
"""


def test_parse_results_reads_the_timed_rows_of_each_section():
    rows = cs.parse_results(FIXTURE, "fixture.md")
    got = [(r.world, r.sample, r.mode, r.backend, r.seconds, r.sent_gib, r.imbalance) for r in rows]
    assert got == [
        (2, "mix", "remat", "auto", 5.962, 4.55, (1.00, 1.00)),
        (2, "mix", cs.ATTENTION_ROW, "auto", 1.002, None, None),
        (2, "prolong", "remat", "cudnn", 2.828, 3.38, (1.04, 1.02)),
        (1, "prolong", "recompute", "auto", 2.678, 0.00, (1.00, 1.00)),
    ]
    first = cs.bench_args(rows[0].command)
    assert (first.layers, first.layout, first.seed, first.steps, first.warmup, first.tokens_per_rank) == (
        4, "tokens", 3, 5, 1, 65536,
    )  # fmt: skip
    last = cs.bench_args(rows[-1].command)
    assert (last.layers, last.layout, last.seed, last.steps) == (8, "distca", 0, 3)


def test_rebuild_is_every_ranks_trained_layout():
    sample = [300, 1200, 5000, 7000, 2500, 700, 4096]
    kwargs = dict(world=2, seed=5)
    rebuilt = cs.rebuild_layouts(sample, tokens_per_rank=4096, count=3, layout="tokens", **kwargs)
    assert len(rebuilt) == 3
    for rank in range(2):
        batches = common.build_batches(
            sample, 4096, 3, rank=rank, layout=LAYOUTS["tokens"], device=torch.device("cpu"), **kwargs
        )
        for all_pieces, batch in zip(rebuilt, batches, strict=True):
            assert batch["distca_layout"].all_pieces == all_pieces
            pieces = all_pieces[rank]
            assert batch["distca_layout"].pieces == pieces
            # the pieces are the tokens this rank trained: lengths fill the budget, positions follow them
            assert sum(n for _, _, n in pieces) == batch["input_ids"].shape[1] == 4096
            expected = torch.cat([torch.arange(start, start + n) for _, start, n in pieces])
            assert torch.equal(batch["position_ids"][0], expected)
    # another layout places the same documents differently: the rebuild follows the command's --layout
    assert cs.rebuild_layouts(sample, tokens_per_rank=4096, count=3, layout="distca", **kwargs) != rebuilt


def test_rebuilt_plans_send_the_bytes_the_gpu_run_counted():
    """The committed 2-GPU 'mix' rows (remat and recompute): the rebuilt micro-batches, planned as the
    engine plans them, send what bench_remat's byte counter recorded and have its imbalance."""
    path = os.path.join(ROOT, "benchmarks", "results", "remat_2xh200.md")
    with open(path) as f:
        rows = [
            r
            for r in cs.parse_results(f.read(), path)
            if r.world == 2 and r.sample == "mix" and r.mode in cs.RECOMPUTE
        ]
    assert {r.mode for r in rows} == {"remat", "recompute"}
    checked = cs.check(rows, {"mix": "mix"})
    for row, predicted in checked:
        assert round(predicted.sent_gib, 2) == row.sent_gib
        assert tuple(round(x, 2) for x in predicted.imbalance) == row.imbalance
    linear = sim.LinearCost.from_measurements().seconds(65536, 8)
    assert all(p.linear_s == pytest.approx(linear, rel=1e-12) for _, p in checked)
