"""benchmarks/check_simulator.py: it rebuilds the micro-batches bench_remat and bench_ping_pong trained and
reads their tables (bench_ping_pong's with or without the ``--passes`` columns).

CPU only, no processes. The rebuild is the benchmarks' own build_batches (benchmarks/common.py) on the CPU; what the check relies
on is that every rank's copy carries every rank's pieces (it reads rank 0's) and that those pieces are the
tokens each rank trained. The committed 2-GPU measurement pins the whole chain: the plans rebuilt from
the table's own command send exactly the bytes the GPU run counted and have its imbalance.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics

import pytest
import torch

from benchmarks import check_simulator as cs
from benchmarks import common, sim
from benchmarks import measured_tables as mt
from hf_distca.data.baselines import LAYOUTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FIXTURE = """# Title

## Checkpointing modes, 2 x NVIDIA H200, llama3-8b-shaped (8 layers)

Command: `NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 -m benchmarks.bench_remat --layout tokens --layers 4 \
--doc-lengths mix --doc-lengths prolong=.gpu_data/doclens_prolong.json --seed 3 --steps 5 --out OUT/x.md`

| sample (tokens in docs >= 16K) | mode | step time (s) | speed-up | peak memory (GiB) | kernels | sent (GiB) | imbalance before -> after |
|---|---|---|---|---|---|---|---|
| mix (57%) | remat | 5.962 | 1.16x | 34.3 | 8 | 4.55 | 1.00 -> 1.00 |
| mix (57%) | none | out of memory | | | | | |
| mix | core-attention forward alone, all layers | 1.002 | recompute - remat = 0.972 s | | | | |
| prolong (17%) | remat (cudnn) | 2.828 | 1.01x | 44.6 | 8 | 3.38 | 1.04 -> 1.02 |

## Consistency check cost, 2 x NVIDIA H200, NCCL

Command: `torchrun --nproc-per-node 2 -m benchmarks.bench_consistency --out OUT/c.md`

| layout | pieces per rank (max) | new layout, check on |
|---|---|---|
| sample (42 documents) | 23 | 0.270 |

## Checkpointing modes, 1 x NVIDIA H200, llama3-8b-shaped (8 layers)

Command: `torchrun --nproc-per-node 1 -m benchmarks.bench_remat --layers 8 --out OUT/y.md`

| sample (tokens in docs >= 16K) | mode | step time (s) | speed-up | peak memory (GiB) | kernels | sent (GiB) | imbalance before -> after |
|---|---|---|---|---|---|---|---|
| prolong (0%) | recompute | 2.678 | 1.00x | 26.7 | 16 | 0.00 | 1.00 -> 1.00 |
"""


def test_parse_results_reads_the_timed_rows_of_each_section():
    rows = mt.parse_results(FIXTURE, "fixture.md")
    got = [(r.world, r.sample, r.mode, r.backend, r.seconds, r.sent_gib, r.imbalance) for r in rows]
    assert got == [
        (2, "mix", "remat", "auto", 5.962, 4.55, (1.00, 1.00)),
        (2, "mix", mt.ATTENTION_ROW, "auto", 1.002, None, None),
        (2, "prolong", "remat", "cudnn", 2.828, 3.38, (1.04, 1.02)),
        (1, "prolong", "recompute", "auto", 2.678, 0.00, (1.00, 1.00)),
    ]
    first = mt.bench_args(rows[0].command)
    assert (first.layers, first.layout, first.seed, first.steps, first.warmup, first.tokens_per_rank) == (
        4, "tokens", 3, 5, 1, 65536,
    )  # fmt: skip
    last = mt.bench_args(rows[-1].command)
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
            for r in mt.parse_results(f.read(), path)
            if r.world == 2 and r.sample == "mix" and r.mode in cs.RECOMPUTE
        ]
    assert {r.mode for r in rows} == {"remat", "recompute"}
    checked = cs.check(rows, {"mix": "mix"})
    for row, predicted in checked:
        assert round(predicted.sent_gib, 2) == row.sent_gib
        assert tuple(round(x, 2) for x in predicted.imbalance) == row.imbalance
    linear = sim.LinearCost.from_measurements().seconds(65536, 8)
    assert all(p.linear_s == pytest.approx(linear, rel=1e-12) for _, p in checked)


PING_PONG_COMMAND = (
    "NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 1 -m benchmarks.bench_ping_pong --layers 2 "
    "--tokens-per-rank 4096,65536 --doc-lengths tiny=.gpu/tiny.json --modes serial,layer_ping_pong "
    "--link none --warmup 1 --steps 3 --seed 0"
)
PING_PONG_FIXTURE = f"""# Layer-level ping-pong

Machine: NVIDIA H200, 580.159.04, 143771 MiB
Software: 3.12.3, torch 2.11.0+cu130, transformers 5.17.0, fla not importable, cudnn 1.32.0

## Ping-pong, 1 x NVIDIA H200, link: none, llama3-8b-shaped (2 layers)

Command: `{PING_PONG_COMMAND}`

| sample / tokens per rank (tokens in docs >= 16K) | mode | step time (s) | vs serial | vs signal | peak memory (GiB) | \
attn fwd kernels / step | core-attn bytes sent / step (GiB) | imbalance before -> after |
|---|---|---|---|---|---|---|---|---|
| tiny / 4K (0%) | serial | 1.263 | 1.00x faster |  | 33.7 | 2 | 0.000 | 1.00 -> 1.00 |
| tiny / 4K (0%) | layer_ping_pong | 1.285 | 0.98x faster |  | 36.3 | 4 | 0.000 | 1.00 -> 1.00 |
| tiny / 64K (0%) | serial | out of memory | | | | | | |

### Timeline: tiny / 4K, layer_ping_pong (one profiled step, rank 0, per layer and pass)

| layer | comm kernels (ms) | hidden behind compute (ms) | exposed (ms) | server kernels (ms) | stages in start order |
|---|---|---|---|---|---|
| bwd 1 | 0.00 | 0.00 (100%) | 0.00 | 8.47 | dispatch.1 dispatch.0 |
| all | 0.0 | 0.0 (100%) | 0.0 | 69.4 | |

Step: kernels from first to last 1200.4 ms, compute idle 32.5 ms. NCCL kernels (all of them, DDP's too): .

## Ping-pong, 2 x NVIDIA H100 80GB HBM3, link: nvlink, llama3-8b-shaped (2 layers)

Command: `torchrun --nproc-per-node 2 -m benchmarks.bench_ping_pong --layers 2 --tokens-per-rank 512 --backend torch_varlen`

| sample / tokens per rank (tokens in docs >= 16K) | mode | step time (s) | vs serial | vs signal | peak memory (GiB) | \
attn fwd kernels / step | core-attn bytes sent / step (GiB) | imbalance before -> after |
|---|---|---|---|---|---|---|---|---|
| mix / 512 (60%) | ping_pong | 0.500 | 1.10x faster | 1.020 | 3.0 | 4 | 0.125 | 1.30 -> 1.01 |
{FIXTURE.split("# Title", 1)[1]}"""


PASSES_COMMAND = (
    "NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 1 -m benchmarks.bench_ping_pong --layers 2 "
    "--tokens-per-rank 4096 --doc-lengths tiny=.gpu/tiny.json --modes serial,serial_tight,layer_ping_pong "
    "--passes 2 --link none --warmup 1 --steps 3 --seed 0"
)
PASSES_FIXTURE = f"""# Layer-level ping-pong, two passes

Machine: NVIDIA H200, 580.159.04, 143771 MiB
Software: 3.12.3, torch 2.11.0+cu130, transformers 5.17.0, fla not importable, cudnn 1.32.0

## Ping-pong, 1 x NVIDIA H200, link: none, llama3-8b-shaped (2 layers)

Command: `{PASSES_COMMAND}`

| sample / tokens per rank (tokens in docs >= 16K) | mode | step time (s) | vs serial | vs signal | peak memory (GiB) | \
attn fwd kernels / step | core-attn bytes sent / step (GiB) | imbalance before -> after | later passes: step time (s), \
vs serial | cuDNN plans built per pass |
|---|---|---|---|---|---|---|---|---|---|---|
| tiny / 4K (0%) | serial | 1.289 | 1.00x faster |  | 33.7 | 2 | 0.000 | 1.00 -> 1.00 | 1.201 (1.00x) | 8 / 0 |
| tiny / 4K (0%) | serial_tight | 1.174 | 1.10x faster |  | 28.4 | 2 | 0.000 | 1.00 -> 1.00 | 1.118 (1.07x) | 2 / 0 |
| tiny / 4K (0%) | layer_ping_pong | 1.274 | 1.01x faster |  | 36.3 | 4 | 0.000 | 1.00 -> 1.00 | 1.127 (1.07x) | 10 / 0 |
"""


def test_parse_results_reads_later_passes_and_plans_built():
    """A --passes table: the first pass stays ``seconds``, the 'later passes' column gives the warm step
    times (the second pass first), the last column the cuDNN plans built per pass; serial_tight parses."""
    rows = mt.parse_results(PASSES_FIXTURE, "passes.md")
    got = [
        (r.mode, r.tokens_per_rank, r.seconds, r.later_s, r.warm_s, r.plans_built, r.fwd_kernels)
        for r in rows
    ]
    assert got == [
        ("serial", 4096, 1.289, (1.201,), 1.201, (8, 0), 2),
        ("serial_tight", 4096, 1.174, (1.118,), 1.118, (2, 0), 2),
        ("layer_ping_pong", 4096, 1.274, (1.127,), 1.127, (10, 0), 4),
    ]  # fmt: skip
    assert mt.ping_pong_args(rows[0].command).passes == 2
    # --passes 3: the later passes comma-separated, the second pass first
    three = PASSES_FIXTURE.replace("--passes 2", "--passes 3").replace(
        "1.127 (1.07x) | 10 / 0 |", "1.127 (1.07x), 1.120 (1.07x) | 10 / 0 / 1 |"
    )
    last = mt.parse_results(three, "passes.md")[-1]
    assert (last.later_s, last.warm_s, last.plans_built) == ((1.127, 1.120), 1.127, (10, 0, 1))
    # a one-pass table (no such columns) has no warm pass
    assert all(r.later_s == () and r.warm_s is None and r.plans_built == ()
               for r in mt.parse_results(PING_PONG_FIXTURE, "pp.md"))  # fmt: skip


def test_parse_results_reads_bench_ping_pong_tables():
    rows = mt.parse_results(PING_PONG_FIXTURE, "pp.md")
    got = [
        (r.world, r.sample, r.tokens_per_rank, r.mode, r.backend, r.seconds, r.sent_gib, r.imbalance,
         r.fwd_kernels, r.device, r.profiled_span_s)
        for r in rows
        if r.tokens_per_rank is not None
    ]  # fmt: skip
    assert got == [
        (1, "tiny", 4096, "serial", "cudnn", 1.263, 0.0, (1.0, 1.0), 2, "NVIDIA H200", None),
        (1, "tiny", 4096, "layer_ping_pong", "cudnn", 1.285, 0.0, (1.0, 1.0), 4, "NVIDIA H200", 1200.4 / 1e3),
        (2, "mix", 512, "ping_pong", "torch_varlen", 0.5, 0.125, (1.30, 1.01), 4, "NVIDIA H100 80GB HBM3", None),
    ]  # fmt: skip
    # the bench_remat sections of the same file still parse as before (the timeline's rows are no steps)
    assert [(r.world, r.mode) for r in rows if r.tokens_per_rank is None] == [
        (2, "remat"), (2, mt.ATTENTION_ROW), (2, "remat"), (1, "recompute"),
    ]  # fmt: skip
    args = mt.ping_pong_args(rows[0].command)
    assert (args.layers, args.seed, args.warmup, args.steps, args.layout) == (2, 0, 1, 3, "distca")
    # without cudnn importable (no 'Software:' line saying so) 'auto' ran torch_varlen
    no_cudnn = PING_PONG_FIXTURE.replace("cudnn 1.32.0", "cudnn not importable")
    assert mt.parse_results(no_cudnn, "pp.md")[0].backend == "torch_varlen"


def _tiny_ping_pong(tmp_path, fixture=PASSES_FIXTURE):
    lengths = [300, 1200, 900, 2500, 700, 1800, 400, 3000, 150, 2200]
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(lengths))
    rows = [r for r in mt.parse_results(fixture, "pp.md") if r.sample == "tiny" and r.tokens_per_rank == 4096]
    return lengths, rows, cs.check_ping_pong(rows, {"tiny": f"tiny={path}"})


def _priced_whole(lengths, tokens_per_rank, setting):
    """simulate.py's step time of these documents run whole through DistCA's engine, laid out at
    ``tokens_per_rank`` (its distca system's layout and plan, simulate.price_plans on the serial schedule)."""
    _, plan, _ = sim.plan_layout(sim.SYSTEM_SPECS["distca"], lengths, setting, tokens_per_rank)
    return sim.price_plans([plan], setting, "serial").step_s


def test_modes_are_priced_as_simulate_prices_their_layouts(tmp_path):
    """The rebuilt micro-batches of the three modes hold the same documents: serial's laid out at the
    budget (padding computed), serial_tight's at the fewest tokens per rank that hold them
    (pad_to_budget=False), layer_ping_pong's as two nano-batches (each at its own tokens per rank) on the
    layer-level schedule; each priced exactly as simulate.py prices those layouts."""
    lengths, rows, checked = _tiny_ping_pong(tmp_path)
    (serial_row, serial), (tight_row, tight), (pp_row, pp) = checked
    assert (serial_row.mode, tight_row.mode, pp_row.mode) == ("serial", "serial_tight", "layer_ping_pong")
    assert (serial.fwd_kernels, tight.fwd_kernels, pp.fwd_kernels) == (2, 2, 4)  # 2 layers x plans
    # the padding is dropped: fewer tokens than the budget, as many as the nano-batches carry
    assert serial.tokens_per_rank == 4096 > tight.tokens_per_rank == pp.tokens_per_rank
    assert tight.step_s < serial.step_s

    args = mt.ping_pong_args(serial_row.command)
    model = dataclasses.replace(sim.ModelShape(), layers=2)
    table = cs.shipped_cost_table("NVIDIA H200", "cudnn", model)
    assert table.endswith("h200_bf16_32x8x128_cudnn.json")
    setting = sim.Setting(
        1, 4096, model, sim.KernelTable.from_json(table), sim.Links(), sim.LinearCost.from_measurements()
    )
    whole = cs.rebuild_nano_layouts(lengths, 4096, args, world=1, nano_batches=1)
    tight_layouts = cs.rebuild_nano_layouts(lengths, 4096, args, world=1, nano_batches=1, pad_to_budget=False)
    nanos = cs.rebuild_nano_layouts(lengths, 4096, args, world=1, nano_batches=2)
    expected: dict[str, list] = {"serial": [], "serial_tight": [], "layer_ping_pong": [], "tight_tokens": []}
    for (micro,), (tight_pieces,), parts in zip(
        whole[args.warmup :], tight_layouts[args.warmup :], nanos[args.warmup :], strict=True
    ):
        assert len(parts) == 2
        docs = [n for nano in parts for _, _, n in nano[0]]  # one rank, no padding: whole documents
        by_id = {doc: n for doc, _, n in micro[0]}
        mb_lengths = [by_id[i] for i in range(len(docs))]  # ids past them: the padding pseudo-document
        assert sorted(mb_lengths) == sorted(docs)  # the same documents in every mode
        assert [n for _, _, n in tight_pieces[0]] == mb_lengths  # tight: those documents, nothing else
        tight_tokens = sum(mb_lengths)
        assert tight_tokens < 4096
        expected["tight_tokens"].append(tight_tokens)
        expected["serial"].append(_priced_whole(mb_lengths, 4096, setting))
        expected["serial_tight"].append(_priced_whole(mb_lengths, tight_tokens, setting))
        expected["layer_ping_pong"].append(
            sim.simulate_micro_batch(sim.SYSTEM_SPECS["distca-layers"], mb_lengths, setting).step_s
        )
    assert serial.step_s == pytest.approx(statistics.median(expected["serial"]), rel=1e-12)
    assert tight.step_s == pytest.approx(statistics.median(expected["serial_tight"]), rel=1e-12)
    assert tight.tokens_per_rank == statistics.median(expected["tight_tokens"])
    assert pp.step_s == pytest.approx(statistics.median(expected["layer_ping_pong"]), rel=1e-12)
    assert pp.last_step_s == pytest.approx(expected["layer_ping_pong"][-1], rel=1e-12)

    report = "\n".join(cs.ping_pong_report(checked))
    # per row: the second (warm) pass first, then the first pass, the prediction, its errors vs both
    error = f"{100 * (tight.step_s - 1.118) / 1.118:+.1f}%"
    assert f"| serial_tight | 1.118 | 1.174 | {tight.step_s:.3f} | {error} |" in report
    ratio = (
        f"| serial / serial_tight (dropped padding) | {1.201 / 1.118:.3f} | {1.289 / 1.174:.3f} "
        f"| {serial.step_s / tight.step_s:.3f} |"
    )
    assert ratio in report
    assert (
        f"| serial / layer_ping_pong (padding and split) | {1.201 / 1.127:.3f} | {1.289 / 1.274:.3f} |"
        in report
    )
    assert "| serial_tight / layer_ping_pong (the split by itself) |" in report


def test_one_pass_tables_are_compared_with_their_only_pass(tmp_path):
    """An old table (no 'later passes' column): the warm columns stay empty, the first pass is compared."""
    _, rows, checked = _tiny_ping_pong(tmp_path, PING_PONG_FIXTURE)
    assert [r.mode for r in rows] == ["serial", "layer_ping_pong"]
    (_, serial), (_, pp) = checked
    report = "\n".join(cs.ping_pong_report(checked))
    error = f"{100 * (serial.step_s - 1.263) / 1.263:+.1f}%"
    assert f"| serial |  | 1.263 | {serial.step_s:.3f} |  | {error} |" in report
    ratio = f"| serial / layer_ping_pong (padding and split) |  | {1.263 / 1.285:.3f} | {serial.step_s / pp.step_s:.3f} |"
    assert ratio in report


def test_committed_layer_ping_pong_rows_rebuild_the_nano_batches_the_gpu_ran():
    """layer_ping_pong_1xh200.md: every rebuilt timed micro-batch of layer_ping_pong splits in two, as the
    GPU's kernel counter (2 x 8 layers per step) recorded, serial's stays whole (8)."""
    # the Pretrain and ProLong length samples of the DistCA paper's evaluation (the public DistCA repository's
    # simulator data) are not part of this repository: give their folder in HF_DISTCA_DOCLENS_DIR
    data = os.environ.get("HF_DISTCA_DOCLENS_DIR", "")
    specs = {name: f"{name}={data}/doclens_{name}.json" for name in ("pretrain", "prolong")}
    if not data or not all(os.path.isfile(s.partition("=")[2]) for s in specs.values()):
        pytest.skip(
            "set HF_DISTCA_DOCLENS_DIR to the folder of doclens_pretrain.json and doclens_prolong.json"
        )
    path = os.path.join(ROOT, "benchmarks", "results", "layer_ping_pong_1xh200.md")
    with open(path) as f:
        rows = [r for r in mt.parse_results(f.read(), path) if r.tokens_per_rank == 32768]
    modes = ("serial", "serial_tight", "layer_ping_pong")
    assert [(r.sample, r.mode) for r in rows] == [(s, m) for s in ("pretrain", "prolong") for m in modes]
    assert all(r.warm_s is not None and len(r.plans_built) == 2 and r.plans_built[1] == 0 for r in rows)
    checked = cs.check_ping_pong(rows, specs)
    for row, predicted in checked:
        assert predicted.fwd_kernels == row.fwd_kernels == (16 if row.mode == "layer_ping_pong" else 8)
        assert (row.profiled_span_s is not None) == (row.mode == "layer_ping_pong")
    # serial_tight carries the nano-batches' tokens (the same documents, no padding), fewer than serial's
    tokens = {(r.sample, r.mode): p.tokens_per_rank for r, p in checked}
    for sample in ("pretrain", "prolong"):
        assert (
            tokens[sample, "serial"]
            == 32768
            > tokens[sample, "serial_tight"]
            == tokens[sample, "layer_ping_pong"]
        )
