"""Ping-pong (DistCAConfig.ping_pong): two nano-batches whose exchanges overlap the other's kernel.

- The split (no processes): every server's tasks are divided into two halves that keep every query row
  once, balance the work, cut a document only when needed and prefer cuts that send no KV row twice;
  every rank's nano-batch index agrees with every other rank's (what one sends, the other receives) and
  the two nano-batches' rows partition each rank's local rows.
- On 2 and 4 gloo processes (one spawn each): on every named layout of the engine tests (documents cut
  over ranks, an empty rank, one giant document, ...), outputs and q/k/v gradients with ping-pong equal
  the float64 oracle, the run without ping-pong (fp32: within tolerance, the sums run in another order)
  and, bit for bit, the reference kernel replayed on every nano-batch task; bytes sent are exactly what
  the nano-batch plans say; the stages run in the interleaved order (the profiler's ranges: nano-batch
  1's dispatch is started before nano-batch 0's kernel, nano-batch 0's return before nano-batch 1's
  kernel, forward and backward); a tiny Llama step with ping-pong gives the same loss and gradients as
  without, with no checkpointing, plain recompute and rematerialization-aware checkpointing (which
  replays the kept outputs: no extra kernels, no extra bytes); signal-only exchanges send one byte.
- Through the recipe under torchrun (2 processes, DDP, gradient checkpointing): ``--ping-pong`` and
  ``--no-ping-pong`` train to the same losses and weights; the flags come from DistCAConfig.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from oracle import TOL, Layout, assert_close, named_layouts, oracle_with_grads, random_qkv
from test_engine_remat import (
    LAYERS,
    LENGTHS,
    MODES,
    PIECES,
    VOCAB,
    assert_grads_close,
    check_modes,
    docs_of,
    global_rows,
    grads_of,
    rank_inputs,
    tiny_llama,
    with_mode,
)
from test_engine_remat import Layout as ModelLayout

from hf_distca import DistCAConfig, core_attention, enable_distca, metrics, plan_core_attention
from hf_distca import engine as eng
from hf_distca.comm import signal_only
from hf_distca.engine.nano import BALANCE, DUPLICATE_GAP, nano_batches, split_server_tasks
from hf_distca.engine.prepare import PreparedAttention
from hf_distca.kernels import reference_varlen_attention
from hf_distca.planning import CATask, DocIndex, build_dispatch_index, causal_pairs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D = 8
HEADS = {"gqa": (4, 2), "mha": (3, 3)}
DTYPES = {"fp64": torch.float64, "fp32": torch.float32}
SPAWN_TIMEOUT = 150
FWD_ORDER = [
    "dispatch.0", "dispatch.1", "wait_dispatch.0", "compute.0", "return.0", "wait_dispatch.1", "compute.1",
    "return.1", "wait_return.0", "wait_return.1",
]  # fmt: skip


# ------------------------------------------------------------------------------- the split, no processes
def _pairs(tasks) -> int:
    return sum(causal_pairs(t.q_start, t.q_end) for t in tasks)


def _rows(tasks) -> set[tuple[int, int]]:
    return {(t.doc_id, i) for t in tasks for i in range(t.q_start, t.q_end)}


def test_ping_pong_split_cases():
    # two local documents of equal work: whole documents, no cut
    index = DocIndex([[(0, 0, 100), (1, 0, 100)], [(2, 0, 10)]])
    a, b = split_server_tasks([CATask(0, 0, 100), CATask(1, 0, 100)], 0, index, 16, 8, 16)
    assert {len(a), len(b)} == {1} and _pairs(a) == _pairs(b)
    # one local document: cut on a multiple of the shard size, halves within one shard's work
    index = DocIndex([[(0, 0, 1000)], [(1, 0, 10)]])
    a, b = split_server_tasks([CATask(0, 0, 1000)], 0, index, 64, 8, 16)
    assert _rows(a) | _rows(b) == _rows([CATask(0, 0, 1000)]) and not _rows(a) & _rows(b)
    cut = max(a + b, key=lambda t: t.q_start).q_start
    assert cut % 64 == 0 and abs(_pairs(a) - _pairs(b)) <= 64 * 1000
    # the tail of a document held elsewhere, nothing else: cut (its remote prefix goes in both dispatches)
    index = DocIndex([[(0, 0, 600)], [(0, 600, 400)]])
    a, b = split_server_tasks([CATask(0, 600, 1000)], 1, index, 16, 8, 16)
    assert a and b and abs(_pairs(a) - _pairs(b)) <= 16 * 1000
    # the same tail beside local documents that balance it to within a third: no KV row is sent twice
    index = DocIndex([[(0, 0, 600)], [(0, 600, 400), (1, 0, 500), (2, 0, 300)]])
    tasks = [CATask(0, 600, 1000), CATask(1, 0, 500), CATask(2, 0, 300)]
    a, b = split_server_tasks(tasks, 1, index, 16, 8, 16)
    remote_halves = [h for h in (a, b) if any(t.doc_id == 0 for t in h)]
    assert len(remote_halves) == 1 and _rows(a) | _rows(b) == _rows(tasks)
    assert abs(_pairs(a) - _pairs(b)) <= (1 / 3) * _pairs(tasks)
    # the half with fewer bytes to receive runs first
    first_in = sum(t.q_len for t in a if t.doc_id == 0)
    second_in = sum(t.q_len for t in b if t.doc_id == 0)
    assert first_in <= second_in
    # a server without work: two empty halves
    assert split_server_tasks([], 0, index, 16, 8, 16) == ([], [])


def _prepared(plan, rank: int, hq: int, hkv: int) -> PreparedAttention:
    index = build_dispatch_index(plan, rank)
    return PreparedAttention(
        plan=plan, index=index, q_heads=hq, kv_heads=hkv, head_dim=D,
        cu_seqlens_q=torch.as_tensor(index.cu_seqlens_q, dtype=torch.int32),
        cu_seqlens_k=torch.as_tensor(index.cu_seqlens_k, dtype=torch.int32), flops_before=[], flops_after=[],
    )  # fmt: skip


@pytest.mark.parametrize("world", [2, 4])
def test_ping_pong_split_layouts_and_indices(world):
    checked_cuts = loose = 0
    for seed in (11, 12):
        for layout in named_layouts(world, seed):
            for shard in (8, 16):
                config = DistCAConfig(shard_tokens=shard, tolerance=0.1)
                plan = plan_core_attention(layout.pieces, q_row_bytes=32, kv_row_bytes=64, config=config)
                splits = [nano_batches(_prepared(plan, r, 4, 2), shard) for r in range(world)]
                label = f"{layout.name}/seed {seed}/shard {shard}"
                for server, tasks in enumerate(plan.tasks):
                    halves = [part.plan.tasks[server] for part in splits[0].parts]
                    # the same halves on every rank, every query row once, canonical order
                    for s in splits[1:]:
                        assert [p.plan.tasks[server] for p in s.parts] == halves, label
                    assert _rows(halves[0]) | _rows(halves[1]) == _rows(tasks), label
                    assert not _rows(halves[0]) & _rows(halves[1]), label
                    assert all(h == sorted(h) for h in halves), label
                    total, gap = _pairs(tasks), abs(_pairs(halves[0]) - _pairs(halves[1]))
                    slack = shard * max((t.q_end for t in tasks), default=0)  # one shard's work
                    if gap > BALANCE * total + slack:
                        # only to avoid sending KV twice: within a third, and no remote KV row read by both
                        assert gap <= DUPLICATE_GAP * total + slack, label
                        for doc in {t.doc_id for t in halves[0]} & {t.doc_id for t in halves[1]}:
                            end = min(max(t.q_end for t in h if t.doc_id == doc) for h in halves)
                            assert plan.index.count_held_by(doc, 0, end, server) == end, label
                        loose += 1
                    checked_cuts += len(halves[0]) + len(halves[1]) > len(tasks)
                for r, split in enumerate(splits):
                    # each nano-batch's rows: the local rows whose queries its tasks compute (all servers)
                    labels = layout.labels(r)
                    for j, part in enumerate(split.parts):
                        computed = set().union(*(_rows(ts) for ts in part.plan.tasks))
                        want = [i for i, label_ in enumerate(labels) if label_ in computed]
                        assert split.rows[j].tolist() == want, label
                    assert sorted(np.concatenate(split.rows).tolist()) == list(range(len(labels))), label
                    for j, part in enumerate(split.parts):
                        ix = part.index
                        assert len(ix.out_gather) == len(split.rows[j]), label
                        assert len(ix.kernel_q_index) == sum(t.q_len for t in part.plan.tasks[r]), label
                        for s in range(world):  # what r sends to s is what s expects from r
                            other = splits[s].parts[j].index
                            assert ix.send_q_counts[s] == other.recv_q_counts[r], label
                            assert ix.send_kv_counts[s] == other.recv_kv_counts[r], label
                            assert ix.out_send_counts[s] == other.out_recv_counts[r], label
    assert checked_cuts > 0  # some task was cut inside a document
    assert loose < checked_cuts  # the exception above stays one


# ------------------------------------------------------------------------------------ worker (ranks)
def _qkv(layout: Layout, rank: int, case: dict):
    hq, hkv = HEADS[case["heads"]]
    q_all, k_all, v_all, w_all = random_qkv(layout.total, hq, hkv, D, DTYPES[case["dtype"]], case["seed"])
    rows = torch.as_tensor(layout.rows(rank))
    return [t[rows].clone() for t in (q_all, k_all, v_all, w_all)]


def _run(q, k, v, w, layout: Layout, rank: int, config: DistCAConfig) -> dict:
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    metrics.reset()
    out = core_attention(*leaves, layout.pieces[rank], config=config, all_pieces=layout.pieces)
    forward = metrics.snapshot()
    out.backward(w)
    return {
        "tensors": [out.detach(), *(t.grad for t in leaves)],
        "forward": forward,
        "total": metrics.snapshot(),
        "runner": type(out.grad_fn.runner).__name__,
    }


def _attention_case(rank: int, case: dict) -> dict:
    layout: Layout = case["layout"]
    q, k, v, w = _qkv(layout, rank, case)
    eng.clear_plan_cache()
    cfg = case["config"]
    serial = _run(q, k, v, w, layout, rank, DistCAConfig(**{**vars(cfg), "ping_pong": False}))
    pp = _run(q, k, v, w, layout, rank, cfg)
    prep = eng.prepare(
        q, k, v, layout.pieces[rank], group=dist.group.WORLD, config=cfg, all_pieces=layout.pieces
    )
    parts = []
    if prep.communicates:
        for part in nano_batches(prep, cfg.shard_tokens).parts:
            ix = part.index
            parts.append({
                "tasks": part.plan.tasks, "sent": part.plan.bytes_sent[rank], "received": part.plan.bytes_received[rank],
                "q_out": sum(ix.send_q_counts), "kv_out": sum(ix.send_kv_counts),
                "q_in": sum(ix.recv_q_counts), "kv_in": sum(ix.recv_kv_counts),
            })  # fmt: skip
    return {"serial": serial, "pp": pp, "parts": parts, "communicates": prep.communicates}


def _schedule_case(rank: int, case: dict) -> dict:
    """The order in which the stages of one forward and backward start (the profiler's ranges)."""
    layout: Layout = case["layout"]
    q, k, v, w = _qkv(layout, rank, case)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = core_attention(*leaves, layout.pieces[rank], config=case["config"], all_pieces=layout.pieces)
        out.backward(w)
    events = sorted((e.time_range.start, e.name) for e in prof.events() if e.name.startswith("distca."))
    return {"order": [name.removeprefix("distca.") for _, name in events]}


def _signal_case(rank: int, case: dict) -> dict:
    layout: Layout = case["layout"]
    q, k, v, w = _qkv(layout, rank, case)
    with signal_only():
        res = _run(q, k, v, w, layout, rank, case["config"])
    res["finite"] = all(bool(torch.isfinite(t).all()) for t in res["tensors"])
    del res["tensors"]
    return res


def _model_case(rank: int, world: int) -> dict:
    """A tiny Llama step with ping-pong in every checkpointing mode, and without ping-pong."""
    base = tiny_llama(seed=7)
    docs = docs_of(LENGTHS, seed=11)
    pieces = PIECES[world][rank]
    ids, pos = rank_inputs(docs, pieces)
    weights = torch.randn(sum(LENGTHS), VOCAB, generator=torch.Generator().manual_seed(13))[
        global_rows(docs, pieces)
    ]
    layout = ModelLayout(PIECES[world])
    runs = {}
    for mode, ping_pong in [*((m, True) for m in MODES), ("serial", False)]:
        model = with_mode(base, "none" if mode == "serial" else mode)
        config = DistCAConfig(shard_tokens=8, tolerance=0.0, ping_pong=ping_pong, backend="reference")
        enable_distca(model, group=dist.group.WORLD, config=config)
        metrics.reset()
        logits = model(input_ids=ids, position_ids=pos, distca_layout=layout.of(rank), use_cache=False).logits
        loss = (logits[0] * weights).sum()
        loss.backward()
        stats = metrics.snapshot()
        total = torch.tensor([float(loss.detach())], dtype=torch.float64)
        dist.all_reduce(total)
        grads = grads_of(model)
        for g in grads.values():
            dist.all_reduce(g)
        runs[mode] = {"loss": float(total), "grads": grads, "stats": stats}
    return runs


def _worker(rank: int, world: int, cases: list[dict]) -> list[dict]:
    run = {"attention": _attention_case, "schedule": _schedule_case, "signal": _signal_case}
    return [_model_case(rank, world) if c["kind"] == "model" else run[c["kind"]](rank, c) for c in cases]


# ------------------------------------------------------------------------------------ parent checks
def _cases(world: int) -> list[dict]:
    cases = []
    for i, layout in enumerate(named_layouts(world, seed=11)):
        for combo, (heads, dtype, shard) in enumerate([("gqa", "fp64", 8), ("mha", "fp32", 16)]):
            tol = 0.3 if layout.name == "giant" else 0.1
            config = DistCAConfig(shard_tokens=shard, tolerance=tol, backend="reference", ping_pong=True)
            cases.append(
                {"kind": "attention", "layout": layout, "heads": heads, "dtype": dtype, "seed": 100 * i + combo,
                 "config": config}
            )  # fmt: skip
    giant = next(c for c in cases if c["layout"].name == "giant")
    cases.append({**giant, "kind": "schedule"})
    cases.append({**giant, "kind": "signal"})
    cases.append({"kind": "model"})
    return cases


def _nano_replay(layout: Layout, parts: list[dict], q_all, k_all, v_all) -> torch.Tensor:
    """Every task of both nano-batches through the reference kernel, one at a time, in this process."""
    out = torch.full_like(q_all, float("nan"))
    offsets = layout.offsets()
    for part in parts:
        for tasks in part["tasks"]:
            for t in tasks:
                base = offsets[t.doc_id]
                qs = q_all[base + t.q_start : base + t.q_end]
                ks, vs = k_all[base : base + t.q_end], v_all[base : base + t.q_end]
                cu_q = torch.tensor([0, t.q_len], dtype=torch.int32)
                cu_k = torch.tensor([0, t.q_end], dtype=torch.int32)
                out[base + t.q_start : base + t.q_end] = reference_varlen_attention(
                    qs, ks, vs, cu_q, cu_k, t.q_len, t.q_end, scale=D**-0.5
                )
    return out


def _check_attention(case: dict, per_rank: list[dict], world: int) -> dict:
    layout: Layout = case["layout"]
    hq, hkv = HEADS[case["heads"]]
    label = f"{layout.name}/{case['heads']}/{case['dtype']}/world={world}"
    q_all, k_all, v_all, w_all = random_qkv(layout.total, hq, hkv, D, DTYPES[case["dtype"]], case["seed"])
    ref = oracle_with_grads(q_all, k_all, v_all, w_all, layout.doc_lens)
    reordered = "fp64_reordered" if case["dtype"] == "fp64" else "fp32"
    communicates = per_rank[0]["communicates"]
    replay = _nano_replay(layout, per_rank[0]["parts"], q_all, k_all, v_all) if communicates else None
    elem = q_all.element_size()
    q_row, kv_row = hq * D * elem, 2 * hkv * D * elem
    extra_kv = 0
    for rank, res in enumerate(per_rank):
        rows = torch.as_tensor(layout.rows(rank))
        pp, serial = res["pp"], res["serial"]
        assert all(r["communicates"] == communicates for r in per_rank), label
        assert pp["runner"] == ("PingPongRunner" if communicates else "EngineRunner"), label
        for name, got, want, other in zip(("out", "dq", "dk", "dv"), pp["tensors"], ref, serial["tensors"]):
            assert got.dtype == DTYPES[case["dtype"]] and got.shape[0] == len(rows), label
            assert_close(got, want[rows], case["dtype"], f"{label} rank {rank} {name} vs oracle")
            assert_close(got, other, reordered, f"{label} rank {rank} {name} vs no ping-pong")
        if not communicates:
            assert pp["total"].bytes_sent == serial["total"].bytes_sent == 0, label
            continue
        assert_close(pp["tensors"][0], replay[rows], "exact", f"{label} rank {rank} out vs nano-batch replay")
        # bytes: exactly the nano-batch plans' traffic, forward and backward (see test_engine_distributed)
        parts = res["parts"]
        fwd, total = pp["forward"], pp["total"]
        assert fwd.bytes_sent == sum(p["sent"] for p in parts), label
        assert fwd.bytes_received == sum(p["received"] for p in parts), label
        bwd_sent = sum(
            (3 * p["q_out"] + p["q_in"]) * q_row + (p["kv_out"] + p["kv_in"]) * kv_row for p in parts
        )
        assert total.bytes_sent == fwd.bytes_sent + bwd_sent, label
        # query rows are partitioned: the same query bytes as without ping-pong; KV rows at least as many
        serial_fwd = serial["forward"].bytes_sent
        assert fwd.bytes_sent >= serial_fwd, label
        extra_kv += fwd.bytes_sent - serial_fwd
        # two kernels on a server with work in both halves, one otherwise (none without work)
        kernels = sum(any(t.q_len for t in p["tasks"][rank]) for p in parts)
        assert (fwd.attn_fwd_kernels, serial["forward"].attn_fwd_kernels) == (
            kernels,
            int(any(t.q_len for p in parts for t in p["tasks"][rank])),
        ), label
    return {"name": layout.name, "communicates": communicates, "extra_kv": extra_kv}


def _check_schedule(per_rank: list[dict]) -> None:
    for rank, res in enumerate(per_rank):
        order = res["order"]
        assert order == [f"fwd.{s}" for s in FWD_ORDER] + [f"bwd.{s}" for s in FWD_ORDER], (rank, order)
        # the claim itself: the other nano-batch's exchange is started before this one's kernel runs
        assert (
            order.index("fwd.dispatch.1") < order.index("fwd.compute.0") < order.index("fwd.wait_dispatch.1")
        )
        assert order.index("fwd.return.0") < order.index("fwd.compute.1") < order.index("fwd.wait_return.0")
        assert order.index("bwd.dispatch.1") < order.index("bwd.compute.0")
        assert order.index("bwd.return.0") < order.index("bwd.compute.1") < order.index("bwd.wait_return.0")


def _check_signal(per_rank: list[dict], world: int) -> None:
    for res in per_rank:
        assert res["runner"] == "PingPongRunner" and res["finite"]
        # 2 nano-batches x (dispatch + return) forward, the same backward: one byte to every rank each
        assert res["total"].bytes_sent == res["total"].bytes_received == 8 * world


def _check_model(per_rank: list[dict], world: int) -> None:
    for rank, runs in enumerate(per_rank):
        label = f"model/{world} rank {rank}"
        check_modes(runs, label, bytes_moved=runs["none"]["stats"].bytes_sent > 0)
        serial = runs["serial"]
        assert abs(runs["none"]["loss"] - serial["loss"]) <= TOL["train_loss"][0] * abs(serial["loss"]), label
        assert_grads_close(runs["none"]["grads"], serial["grads"], f"{label} ping-pong vs not")
        # ping-pong ran: two kernels per layer on this rank where the serial run had one
        assert runs["none"]["stats"].attn_fwd_kernels > serial["stats"].attn_fwd_kernels, label
        assert runs["remat"]["stats"].attn_replays == LAYERS, label


@pytest.mark.parametrize("world", [2, 4])
def test_ping_pong_engine_distributed(world):
    """Every case of this module that needs processes, in one spawn per world size."""
    cases = _cases(world)
    results = run_distributed(_worker, world, cases, timeout=SPAWN_TIMEOUT)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like the ranks: the nano-batch replay then runs the kernel with the same bits
    summaries = []
    try:
        for i, case in enumerate(cases):
            per_rank = [results[r][i] for r in range(world)]
            if case["kind"] == "attention":
                summaries.append(_check_attention(case, per_rank, world))
            elif case["kind"] == "schedule":
                _check_schedule(per_rank)
            elif case["kind"] == "signal":
                _check_signal(per_rank, world)
            else:
                _check_model(per_rank, world)
    finally:
        torch.set_num_threads(threads)
    # ping-pong really ran on most layouts, including documents cut over ranks and the empty rank
    ran = {s["name"] for s in summaries if s["communicates"]}
    assert {"spans", "giant", "empty_rank", "nonadjacent"} <= ran, ran


# ------------------------------------------------------------------------------- the recipe (DDP)
def test_ping_pong_flags_come_from_the_config():
    from test_recipe import load_recipe

    from hf_distca.cli import config_from_args

    recipe = load_recipe()
    assert config_from_args(recipe.parse_args([])).ping_pong is None
    assert config_from_args(recipe.parse_args(["--ping-pong"])).ping_pong is True
    assert config_from_args(recipe.parse_args(["--no-ping-pong"])).ping_pong is False
    with pytest.raises(ValueError, match="ping_pong must be True, False or None"):
        DistCAConfig(ping_pong=1)


def test_ping_pong_recipe_ddp_matches(tmp_path):
    """recipes/finetune_long_docs.py on 2 processes (DDP, gloo, gradient checkpointing, which keeps
    the attention outputs): the same losses and final weights with and without ping-pong."""
    from safetensors.torch import load_file

    common = [
        "--max-steps", "2", "--grad-accum", "2", "--optim", "sgd", "--learning-rate", "0.5", "--num-documents", "60",
        "--mean-doc-words", "300", "--max-doc-words", "1500", "--shard-tokens", "64", "--seed", "3",
        "--tokens-per-rank", "1024", "--gradient-checkpointing",
    ]  # fmt: skip
    runs = [
        ["finetune_long_docs.py", [*common, flag, "--output-dir", str(tmp_path / flag)]]
        for flag in ("--ping-pong", "--no-ping-pong")
    ]
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        os.path.join(ROOT, "tests", "run_recipes.py"), str(tmp_path / "runs.json"),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    records, weights = {}, {}
    for flag in ("--ping-pong", "--no-ping-pong"):
        out = tmp_path / flag
        records[flag] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        weights[flag] = load_file(str(out / "model" / "model.safetensors"))
    pp, serial = records["--ping-pong"], records["--no-ping-pong"]
    assert [r["step"] for r in pp] == [r["step"] for r in serial] == [1, 2]
    for got, want in zip(pp, serial, strict=True):
        assert abs(got["loss"] - want["loss"]) <= TOL["train_loss"][0] * abs(want["loss"]), (got, want)
        assert sum(want["bytes_sent"]) > 0  # documents cut over ranks: the engine communicated
        # ping-pong ran: two server kernels per layer where the serial run has one
        assert sum(got["attn_fwd_kernels"]) > sum(want["attn_fwd_kernels"]), (got, want)
    assert weights["--ping-pong"].keys() == weights["--no-ping-pong"].keys()
    for name, w in weights["--ping-pong"].items():
        torch.testing.assert_close(w, weights["--no-ping-pong"][name], rtol=0, atol=TOL["train_weights"][1])
