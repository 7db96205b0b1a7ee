"""Ping-pong (DistCAConfig.ping_pong): nano-batches whose exchanges overlap other nano-batches' kernels.

- The split (no processes), both ways (``local_first``: local work in two halves around the exchanged
  work; ``halves``): every server's tasks go to parts that keep every query row once, balance the work,
  cut a document only when needed and never (local_first) or only as a last resort (halves) send a KV
  row to a server twice; every rank's nano-batch index agrees with every other rank's (what one sends,
  the other receives) and the nano-batches' rows partition each rank's local rows.
- On 2 and 4 gloo processes (one spawn each): on every named layout of the engine tests (documents cut
  over ranks, an empty rank, one giant document, ...), with both splits, outputs and q/k/v gradients with
  ping-pong equal the float64 oracle, the run without ping-pong (fp32: within tolerance, the sums run in
  another order) and, bit for bit, the reference kernel replayed on every nano-batch task; bytes sent are
  exactly what the nano-batch plans say (local_first: exactly the bytes without ping-pong); the stages
  run in the interleaved order (the profiler's ranges: an exchanging part's dispatch is started before an
  earlier part's kernel and its return before a later part's kernel, forward and backward); a tiny Llama
  step with ping-pong gives the same loss and gradients as without, with no checkpointing, plain
  recompute and rematerialization-aware checkpointing (which replays the kept outputs: no extra kernels,
  no extra bytes); signal-only exchanges send one byte.
- Through the recipe on 2 processes (tests/run_recipes.py, DDP, gradient checkpointing): ``--ping-pong`` and
  ``--no-ping-pong`` train to the same losses and weights; the flags come from DistCAConfig.
- benchmarks/bench_ping_pong.py: its trace summary (benchmarks/trace_summary.py) on a hand-made trace, and its ``--cpu`` smoke run.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed import check_cases, run_distributed
from engine_bytes import exchange_bytes, nonzero, phase_counts
from oracle import TOL, Layout, assert_close, named_layouts, oracle_with_grads, random_qkv
from run_recipes import launch
from test_engine_remat import LAYERS, MODES, assert_grads_close, check_modes, run_model_steps

from benchmarks.signal_only import signal_only
from benchmarks.trace_summary import summarize_trace
from hf_distca import DistCAConfig, core_attention, metrics, plan_core_attention
from hf_distca import engine as eng
from hf_distca.engine.ping_pong import ping_pong_parts
from hf_distca.engine.prepare import PreparedAttention
from hf_distca.kernels import reference_varlen_attention
from hf_distca.planning import CATask, DocIndex, build_dispatch_index, causal_pairs, traffic
from hf_distca.planning.ping_pong import BALANCE, DUPLICATE_GAP, split_server_tasks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D = 8
HEADS = {"gqa": (4, 2), "mha": (3, 3)}
DTYPES = {"fp64": torch.float64, "fp32": torch.float32}
SPAWN_TIMEOUT = 150


def stage_order(parts: int) -> list[str]:
    """The ping-pong schedule of one pass: every dispatch, then per part its wait, kernel and return, then
    the waits for the returns."""
    per_part = [f"{stage}.{j}" for j in range(parts) for stage in ("wait_dispatch", "compute", "return")]
    return [f"dispatch.{j}" for j in range(parts)] + per_part + [f"wait_return.{j}" for j in range(parts)]


# ------------------------------------------------------------------------------- the split, no processes
def _pairs(tasks) -> int:
    return sum(causal_pairs(t.q_start, t.q_end) for t in tasks)


def _rows(tasks) -> set[tuple[int, int]]:
    return {(t.doc_id, i) for t in tasks for i in range(t.q_start, t.q_end)}


def test_ping_pong_split_halves():
    def halves(tasks, server, index, shard):
        return split_server_tasks(tasks, server, index, shard, 8, 16, "halves")

    # two local documents of equal work: whole documents, no cut
    index = DocIndex([[(0, 0, 100), (1, 0, 100)], [(2, 0, 10)]])
    a, b = halves([CATask(0, 0, 100), CATask(1, 0, 100)], 0, index, 16)
    assert {len(a), len(b)} == {1} and _pairs(a) == _pairs(b)
    # one local document: cut on a multiple of the shard size, halves within one shard's work
    index = DocIndex([[(0, 0, 1000)], [(1, 0, 10)]])
    a, b = halves([CATask(0, 0, 1000)], 0, index, 64)
    assert _rows(a) | _rows(b) == _rows([CATask(0, 0, 1000)]) and not _rows(a) & _rows(b)
    cut = max(a + b, key=lambda t: t.q_start).q_start
    assert cut % 64 == 0 and abs(_pairs(a) - _pairs(b)) <= 64 * 1000
    # the tail of a document held elsewhere, nothing else: cut (its remote prefix goes in both dispatches)
    index = DocIndex([[(0, 0, 600)], [(0, 600, 400)]])
    a, b = halves([CATask(0, 600, 1000)], 1, index, 16)
    assert a and b and abs(_pairs(a) - _pairs(b)) <= 16 * 1000
    # the same tail beside local documents that balance it to within a third: no KV row is sent twice
    index = DocIndex([[(0, 0, 600)], [(0, 600, 400), (1, 0, 500), (2, 0, 300)]])
    tasks = [CATask(0, 600, 1000), CATask(1, 0, 500), CATask(2, 0, 300)]
    a, b = halves(tasks, 1, index, 16)
    remote_halves = [h for h in (a, b) if any(t.doc_id == 0 for t in h)]
    assert len(remote_halves) == 1 and _rows(a) | _rows(b) == _rows(tasks)
    assert abs(_pairs(a) - _pairs(b)) <= DUPLICATE_GAP * _pairs(tasks)
    assert remote_halves[0] is b  # the half with fewer bytes to receive runs first
    # a server without work: two empty halves
    assert halves([], 0, index, 16) == [[], []]


def test_ping_pong_split_local_first():
    # server 1: its own documents 1 and 2 (local), the tail of document 0 (KV prefix on rank 0), and a shard
    # of document 3 whose queries rank 0 holds
    index = DocIndex([[(0, 0, 600), (3, 0, 200)], [(0, 600, 400), (1, 0, 500), (2, 0, 300)]])
    tasks = [CATask(0, 600, 1000), CATask(1, 0, 500), CATask(2, 0, 300), CATask(3, 100, 200)]
    head, remote0, remote1, tail = split_server_tasks(tasks, 1, index, 16, 8, 16)
    assert _rows(head) | _rows(tail) == _rows(tasks[1:3]) and not _rows(head) & _rows(tail)
    assert abs(_pairs(head) - _pairs(tail)) <= 16 * 500  # the local work halved (document 1 cut: free)
    # the remote work halved by whole documents (no KV row twice), fewer bytes to receive first
    assert (remote0, remote1) == ([CATask(3, 100, 200)], [CATask(0, 600, 1000)])
    # only remote work: the local parts are empty; one remote document is never cut
    index = DocIndex([[(0, 0, 600)], [(0, 600, 400)]])
    assert split_server_tasks([CATask(0, 600, 1000)], 1, index, 16, 8, 16) == [
        [],
        [],
        [CATask(0, 600, 1000)],
        [],
    ]


def _prepared(plan, rank: int, hq: int, hkv: int) -> PreparedAttention:
    index = build_dispatch_index(plan, rank)
    return PreparedAttention(
        plan=plan, index=index, q_heads=hq, kv_heads=hkv, head_dim=D,
        cu_seqlens_q=torch.as_tensor(index.cu_seqlens_q, dtype=torch.int32),
        cu_seqlens_k=torch.as_tensor(index.cu_seqlens_k, dtype=torch.int32), flops_before=[], flops_after=[],
    )  # fmt: skip


def _shared_remote_rows(parts: list[list[CATask]], server: int, index: DocIndex) -> int:
    """KV rows of other ranks that two parts of one server both read (what a server receives twice)."""
    twice = 0
    for i, a in enumerate(parts):
        for b in parts[i + 1 :]:
            for doc in {t.doc_id for t in a} & {t.doc_id for t in b}:
                end = min(max(t.q_end for t in part if t.doc_id == doc) for part in (a, b))
                twice += end - index.count_held_by(doc, 0, end, server)
    return twice


@pytest.mark.parametrize("world", [2, 4])
def test_ping_pong_split_layouts_and_indices(world):
    checked_cuts = loose = 0
    for seed in (11, 12):
        for layout in named_layouts(world, seed):
            for shard, split in ((8, "halves"), (16, "halves"), (8, "local_first")):
                config = DistCAConfig(shard_tokens=shard, tolerance=0.1)
                plan = plan_core_attention(
                    layout.pieces, q_row_bytes=32, kv_row_bytes=64, options=config.planner_options()
                )
                splits = [ping_pong_parts(_prepared(plan, r, 4, 2), shard, split) for r in range(world)]
                label = f"{layout.name}/seed {seed}/shard {shard}/{split}"
                for server, tasks in enumerate(plan.tasks):
                    parts = [part.plan.tasks[server] for part in splits[0].parts]
                    # the same parts on every rank, every query row once, canonical order
                    for s in splits[1:]:
                        assert [p.plan.tasks[server] for p in s.parts] == parts, label
                    assert set().union(*map(_rows, parts)) == _rows(tasks), label
                    assert sum(len(_rows(p)) for p in parts) == len(_rows(tasks)), label
                    assert all(p == sorted(p) for p in parts), label
                    checked_cuts += sum(map(len, parts)) > len(tasks)
                    slack = shard * max((t.q_end for t in tasks), default=0)  # one shard's work
                    if split == "local_first":
                        assert _shared_remote_rows(parts, server, plan.index) == 0, label
                        continue
                    total, gap = _pairs(tasks), abs(_pairs(parts[0]) - _pairs(parts[1]))
                    if gap > BALANCE * total + slack:
                        # only to avoid sending KV twice: within a third, and no remote KV row read twice
                        assert gap <= DUPLICATE_GAP * total + slack, label
                        assert _shared_remote_rows(parts, server, plan.index) == 0, label
                        loose += 1
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
        "runner_parts": len(out.grad_fn.runner.split.parts),
    }


def _attention_case(rank: int, case: dict) -> dict:
    layout: Layout = case["layout"]
    q, k, v, w = _qkv(layout, rank, case)
    eng.engine_state().reset()
    cfg = case["config"]
    serial = _run(q, k, v, w, layout, rank, DistCAConfig(**{**vars(cfg), "ping_pong": False}))
    pp = _run(q, k, v, w, layout, rank, cfg)
    prep = eng.prepare(
        q, k, v, layout.pieces[rank], group=dist.group.WORLD, config=cfg, all_pieces=layout.pieces
    )
    return {"serial": serial, "pp": pp, "parts": _parts(prep, rank, cfg), "communicates": prep.communicates}


def _parts(prep, rank: int, cfg: DistCAConfig) -> list[dict]:
    """What each nano-batch of ``prep`` holds and moves for this rank (none when nothing is exchanged)."""
    if not prep.communicates:
        return []
    parts = []
    for part in ping_pong_parts(prep, cfg.shard_tokens, cfg.ping_pong_split).parts:
        ix = part.index
        parts.append({
            "tasks": part.plan.tasks, "sent": part.plan.bytes_sent[rank], "received": part.plan.bytes_received[rank],
            "q_out": sum(ix.send_q_counts), "kv_out": sum(ix.send_kv_counts),
            "q_in": sum(ix.recv_q_counts), "kv_in": sum(ix.recv_kv_counts), "communicates": part.communicates,
            "ledger": traffic.plan_bytes(part.plan),
        })  # fmt: skip
    return parts


def _schedule_case(rank: int, case: dict) -> dict:
    """The order in which the stages of one forward and backward start (the profiler's ranges)."""
    layout: Layout = case["layout"]
    q, k, v, w = _qkv(layout, rank, case)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = core_attention(*leaves, layout.pieces[rank], config=case["config"], all_pieces=layout.pieces)
        out.backward(w)
    events = sorted((e.time_range.start, e.name) for e in prof.events() if e.name.startswith("distca."))
    prep = eng.prepare(
        q, k, v, layout.pieces[rank], group=dist.group.WORLD, config=case["config"], all_pieces=layout.pieces
    )
    parts = [p["communicates"] for p in _parts(prep, rank, case["config"])]
    return {"order": [name.removeprefix("distca.") for _, name in events], "parts": parts}


def _signal_case(rank: int, case: dict) -> dict:
    layout: Layout = case["layout"]
    q, k, v, w = _qkv(layout, rank, case)
    with signal_only():
        res = _run(q, k, v, w, layout, rank, case["config"])
    res["finite"] = all(bool(torch.isfinite(t).all()) for t in res["tensors"])
    prep = eng.prepare(
        q, k, v, layout.pieces[rank], group=dist.group.WORLD, config=case["config"], all_pieces=layout.pieces
    )
    res["exchanging_parts"] = sum(p["communicates"] for p in _parts(prep, rank, case["config"]))
    del res["tensors"]
    return res


def _model_case(rank: int, world: int) -> dict:
    """A tiny Llama step with ping-pong in every checkpointing mode, and without ping-pong."""
    runs = {}
    for name, ping_pong, split in [*((m, True, "local_first") for m in MODES), ("halves", True, "halves"),
                                   ("serial", False, "local_first")]:  # fmt: skip
        config = DistCAConfig(
            shard_tokens=8, tolerance=0.0, ping_pong=ping_pong, ping_pong_split=split, backend="reference"
        )
        runs[name] = (name if name in MODES else "none", config)
    return run_model_steps(rank, world, runs)


def _worker(rank: int, world: int, cases: list[dict]) -> list[dict]:
    run = {"attention": _attention_case, "schedule": _schedule_case, "signal": _signal_case}
    return [_model_case(rank, world) if c["kind"] == "model" else run[c["kind"]](rank, c) for c in cases]


# ------------------------------------------------------------------------------------ parent checks
def _cases(world: int) -> list[dict]:
    cases = []
    combos = [
        ("gqa", "fp64", 8, "local_first"),
        ("mha", "fp32", 16, "local_first"),
        ("gqa", "fp32", 8, "halves"),
    ]
    for i, layout in enumerate(named_layouts(world, seed=11)):
        for combo, (heads, dtype, shard, split) in enumerate(combos):
            tol = 0.3 if layout.name == "giant" else 0.1
            config = DistCAConfig(
                shard_tokens=shard, tolerance=tol, backend="reference", ping_pong=True, ping_pong_split=split
            )
            cases.append(
                {"kind": "attention", "layout": layout, "heads": heads, "dtype": dtype, "seed": 100 * i + combo,
                 "config": config}
            )  # fmt: skip
    giant = [c for c in cases if c["layout"].name == "giant"]
    cases += [{**c, "kind": "schedule"} for c in giant[1:]]  # fp32, both splits
    cases.append({**giant[0], "kind": "signal"})
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
    split = case["config"].ping_pong_split
    label = f"{layout.name}/{case['heads']}/{case['dtype']}/{split}/world={world}"
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
        # nano-batches only when the plan exchanges rows; else (and without ping-pong) one part: serial
        assert pp["runner"] == serial["runner"] == "PingPongRunner", label
        assert pp["runner_parts"] == (len(res["parts"]) if communicates else 1), label
        assert serial["runner_parts"] == 1, label
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
            exchange_bytes(p["q_out"], p["kv_out"], p["q_in"], p["kv_in"], q_row, kv_row)["bwd_sent"]
            for p in parts
        )
        assert total.bytes_sent == fwd.bytes_sent + bwd_sent, label
        # phase by phase, the measured bytes are the ledger's over the nano-batch plans
        ledger = sum(p["ledger"] for p in parts)
        assert nonzero(fwd.phase_bytes) == phase_counts(ledger, rank, 1, 0), label
        assert nonzero(total.phase_bytes) == phase_counts(ledger, rank, 1, 1), label
        # query rows are partitioned: the same query bytes as without ping-pong; KV rows at least as many,
        # and exactly as many with the local_first split (no KV row goes to a server twice)
        serial_fwd = serial["forward"].bytes_sent
        assert fwd.bytes_sent >= serial_fwd, label
        if split == "local_first":
            assert (fwd.bytes_sent, total.bytes_sent) == (serial_fwd, serial["total"].bytes_sent), label
        extra_kv += fwd.bytes_sent - serial_fwd
        # one kernel per part with work on this server (the serial run: one if it has any work)
        kernels = sum(any(t.q_len for t in p["tasks"][rank]) for p in parts)
        assert (fwd.attn_fwd_kernels, serial["forward"].attn_fwd_kernels) == (
            kernels,
            int(any(t.q_len for p in parts for t in p["tasks"][rank])),
        ), label
    return {"name": layout.name, "split": split, "communicates": communicates, "extra_kv": extra_kv}


def _check_schedule(case: dict, per_rank: list[dict]) -> None:
    for rank, res in enumerate(per_rank):
        order, exchanging = res["order"], res["parts"]
        n = len(exchanging)
        if case["config"].ping_pong_split == "local_first":  # the giant document: local work on both sides
            assert n == 3 and exchanging == [False, True, False], exchanging
        else:
            assert n == 2 and all(exchanging), exchanging
        assert order == [f"fwd.{s}" for s in stage_order(n)] + [f"bwd.{s}" for s in stage_order(n)], (
            rank,
            order,
        )
        # the claim itself: an exchanging part's dispatch is started before an earlier part's kernel runs,
        # and its return before a later part's kernel; forward and backward
        first = next(j for j in range(1, n) if exchanging[j])
        last = next(j for j in range(n - 2, -1, -1) if exchanging[j])
        for phase in ("fwd", "bwd"):
            at = {name: i for i, name in enumerate(order) if name.startswith(phase)}
            assert (
                at[f"{phase}.dispatch.{first}"]
                < at[f"{phase}.compute.0"]
                < at[f"{phase}.wait_dispatch.{first}"]
            )
            assert (
                at[f"{phase}.return.{last}"]
                < at[f"{phase}.compute.{n - 1}"]
                < at[f"{phase}.wait_return.{last}"]
            )


def _check_signal(per_rank: list[dict], world: int) -> None:
    for res in per_rank:
        assert res["runner"] == "PingPongRunner" and res["finite"] and res["exchanging_parts"] > 0
        # per exchanging part, dispatch and return forward and backward: one byte to every rank each
        assert res["total"].bytes_sent == res["total"].bytes_received == 4 * res["exchanging_parts"] * world


def _check_model(per_rank: list[dict], world: int) -> None:
    for rank, runs in enumerate(per_rank):
        label = f"model/{world} rank {rank}"
        check_modes(runs, label, bytes_moved=runs["none"]["stats"].bytes_sent > 0)
        serial = runs["serial"]
        for run in ("none", "halves"):  # local_first without checkpointing, and halves
            assert abs(runs[run]["loss"] - serial["loss"]) <= TOL["train_loss"][0] * abs(serial["loss"]), (
                label
            )
            assert_grads_close(runs[run]["grads"], serial["grads"], f"{label} ping-pong ({run}) vs not")
            assert runs[run]["stats"].attn_fwd_kernels >= serial["stats"].attn_fwd_kernels, label
        assert runs["remat"]["stats"].attn_replays == LAYERS, label
    # ping-pong ran: more kernels than the serial run's one per layer
    for run in ("none", "halves"):
        assert any(
            r[run]["stats"].attn_fwd_kernels > r["serial"]["stats"].attn_fwd_kernels for r in per_rank
        ), run


@pytest.mark.parametrize("world", [2, 4])
def test_ping_pong_engine_distributed(world):
    """Every case of this module that needs processes, in one spawn per world size."""
    cases = _cases(world)
    results = run_distributed(_worker, world, cases, timeout=SPAWN_TIMEOUT)
    checks = {
        "attention": lambda case, per_rank: _check_attention(case, per_rank, world),
        "schedule": lambda case, per_rank: _check_schedule(case, per_rank),
        "signal": lambda case, per_rank: _check_signal(per_rank, world),
        "model": lambda case, per_rank: _check_model(per_rank, world),
    }
    summaries = check_cases(cases, results, checks)["attention"]
    # ping-pong really ran on most layouts, including documents cut over ranks and the empty rank
    for split in ("local_first", "halves"):
        ran = {s["name"] for s in summaries if s["communicates"] and s["split"] == split}
        assert {"spans", "giant", "empty_rank", "nonadjacent"} <= ran, (split, ran)


# ------------------------------------------------------------------------------- the recipe (DDP)
def test_ping_pong_flags_come_from_the_config():
    from test_recipe import load_recipe

    from hf_distca.cli import config_from_args

    recipe = load_recipe()
    assert config_from_args(recipe.parse_args([])).ping_pong is False
    assert config_from_args(recipe.parse_args(["--ping-pong"])).ping_pong is True
    assert config_from_args(recipe.parse_args(["--no-ping-pong"])).ping_pong is False
    with pytest.raises(ValueError, match="ping_pong must be True, False or None"):
        DistCAConfig(ping_pong=1)


@pytest.mark.parametrize("flag", ["--ping-pong", "--layer-ping-pong"])
def test_ping_pong_recipe_ddp_matches(tmp_path, flag):
    """recipes/finetune_long_docs.py on 2 processes (DDP, gloo, gradient checkpointing, which keeps
    the attention outputs, 2 micro-batches per step): the same losses and final weights with and without
    ping-pong, attention-level (``--ping-pong``) or layer-level (``--layer-ping-pong``: the Trainer's
    compute_loss runs the two nano-batches' forwards interleaved)."""
    from safetensors.torch import load_file

    common = [
        "--max-steps", "2", "--grad-accum", "2", "--optim", "sgd", "--learning-rate", "0.5", "--num-documents", "60",
        "--mean-doc-words", "300", "--max-doc-words", "1500", "--shard-tokens", "64", "--seed", "3",
        "--tokens-per-rank", "1024", "--gradient-checkpointing",
    ]  # fmt: skip
    off = "--no-" + flag[2:]
    runs = [["finetune_long_docs.py", [*common, f, "--output-dir", str(tmp_path / f)]] for f in (flag, off)]
    launch(2, runs, tmp_path)
    records, weights = {}, {}
    for f in (flag, off):
        out = tmp_path / f
        records[f] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        weights[f] = load_file(str(out / "model" / "model.safetensors"))
    pp, serial = records[flag], records[off]
    assert [r["step"] for r in pp] == [r["step"] for r in serial] == [1, 2]
    for got, want in zip(pp, serial, strict=True):
        assert abs(got["loss"] - want["loss"]) <= TOL["train_loss"][0] * abs(want["loss"]), (got, want)
        assert sum(want["bytes_sent"]) > 0  # documents cut over ranks: the engine communicated
        # ping-pong ran: two server kernels per layer (one per nano-batch) where the serial run has one
        assert sum(got["attn_fwd_kernels"]) > sum(want["attn_fwd_kernels"]), (got, want)
    assert weights[flag].keys() == weights[off].keys()
    for name, w in weights[flag].items():
        torch.testing.assert_close(w, weights[off][name], rtol=0, atol=TOL["train_weights"][1])


def _gpu_engine_check(rank: int, world: int) -> int:
    import gpu_nccl_engine_check

    return gpu_nccl_engine_check.main(
        ["--backend", "gloo", "--cpu", "--repeat", "1", "--ranks-per-node", "2"]
    )


def test_gpu_engine_check_script_on_cpu():
    """tests/gpu_nccl_engine_check.py, the GPU check of every schedule (serial, ping-pong with each split, and
    both through the KV relay) in bf16 against the float64 oracle, run as on GPUs but on 4 gloo CPU processes
    in 2 "nodes": it passes (exit code 0 on every rank; it fails when the relay forwarded nothing), so the
    script the GPU runs use cannot rot unseen."""
    assert run_distributed(_gpu_engine_check, 4) == [0] * 4


# ---------------------------------------------------------------------------- the GPU benchmark
def test_ping_pong_bench_trace_summary():
    """The timeline summary on a hand-made trace: an NCCL kernel of 10 us of which 4 run beside a
    compute kernel; the server kernel counted for its call; calls numbered per pass."""

    def cpu(name, ts, dur, tid=1):
        return {
            "ph": "X",
            "cat": "user_annotation",
            "name": f"distca.{name}",
            "ts": ts,
            "dur": dur,
            "tid": tid,
        }

    def kernel_launch(corr, ts, tid=1):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "tid": tid,
                "args": {"correlation": corr}}  # fmt: skip

    def kernel(name, corr, ts, dur, stream):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr, "stream": stream}}  # fmt: skip

    events = [
        cpu("fwd.dispatch.0", 0, 2), kernel_launch(1, 1),  # nano-batch 0's all-to-all: GPU 100-110
        cpu("fwd.dispatch.1", 3, 2), kernel_launch(2, 4),  # nano-batch 1's: GPU 110-120
        cpu("fwd.compute.0", 6, 3), kernel_launch(3, 7),  # the server kernel: GPU 116-130
        kernel_launch(4, 20), kernel_launch(5, 40, tid=2),  # a kernel outside any range; one on another thread
        cpu("bwd.dispatch.0", 50, 2), kernel_launch(6, 51),
        kernel("ncclDevKernel_SendRecv(x)", 1, 100, 10, 20),
        kernel("ncclDevKernel_SendRecv(x)", 2, 110, 10, 20),
        kernel("flash_fwd_kernel", 3, 116, 14, 7),
        kernel("gemm", 4, 130, 5, 7),
        kernel("ncclDevKernel_AllReduce(y)", 5, 132, 6, 21),
        kernel("ncclDevKernel_SendRecv(x)", 6, 140, 8, 20),
    ]  # fmt: skip
    summary = summarize_trace({"traceEvents": events})
    fwd, bwd = summary["calls"]
    assert (fwd["pass"], fwd["call"], bwd["pass"], bwd["call"]) == ("fwd", 0, "bwd", 0)
    assert fwd["stages"] == ["dispatch.0", "dispatch.1", "compute.0"]
    assert fwd["comm_ms"] == pytest.approx(0.020) and fwd["hidden_ms"] == pytest.approx(0.004)
    assert fwd["exposed_ms"] == pytest.approx(0.016) and fwd["server_ms"] == pytest.approx(0.014)
    assert bwd["comm_ms"] == pytest.approx(0.008) and bwd["hidden_ms"] == 0 and bwd["server_ms"] == 0
    assert summary["nccl"]["ncclDevKernel_AllReduce"] == {
        "ms": pytest.approx(0.006),
        "hidden_ms": pytest.approx(0.003),
    }
    assert summary["span_ms"] == pytest.approx(0.048) and summary["compute_busy_ms"] == pytest.approx(0.019)


def test_ping_pong_bench_cpu_smoke(tmp_path):
    """benchmarks/bench_ping_pong.py --cpu on 2 gloo processes: every mode runs on the same batches and
    the report has its rows, byte counts that say which mode communicated, and the profiled timeline."""
    # documents longer than a rank's share (cut over the ranks: the engine exchanges) and shorter ones, so
    # that every micro-batch (any two documents fit in one) also splits into two nano-batches of whole documents
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([1100, 700, 900, 600]))
    argv = [
        "--cpu", "--model", "tiny-llama", "--layers", "2", "--tokens-per-rank", "1024", "--doc-lengths",
        f"smoke={lengths}", "--warmup", "0", "--steps", "1", "--backend", "reference", "--profile", "ping_pong",
        "--link", "gloo", "--out", str(tmp_path / "pp.md"), "--json", str(tmp_path / "pp.json"),
        "--trace-dir", str(tmp_path / "traces"), "--passes", "2",
    ]  # fmt: skip
    launch(2, [["benchmarks.bench_ping_pong", argv]], tmp_path)
    results = json.loads((tmp_path / "pp.json").read_text())
    (res,) = results.values()
    modes = res["modes"]
    assert list(modes) == [
        "ping_pong", "ping_pong_halves", "layer_ping_pong", "serial", "serial_tight", "signal", "signal_pp",
        "signal_layers", "unbalanced",
    ]  # fmt: skip
    # each mode timed twice; the same documents without the padding to --tokens-per-rank: fewer tokens
    assert all(len(m["passes"]) == len(m["plans_built"]) == 2 for m in modes.values())
    assert modes["serial_tight"]["tokens_per_step"] < modes["serial"]["tokens_per_step"] == 1024
    assert modes["serial_tight"]["kernels"] == modes["serial"]["kernels"]
    # layer-level: one server kernel per nano-batch and layer; signal-only layers send 1-byte messages
    assert modes["layer_ping_pong"]["kernels"] == 2 * modes["serial"]["kernels"]
    assert modes["layer_ping_pong"]["sent_gib"] > 1000 * modes["signal_layers"]["sent_gib"] > 0
    # ping-pong runs more server kernels per layer than serial's one; signal-only sends 1-byte messages
    assert modes["ping_pong_halves"]["kernels"] == 2 * modes["serial"]["kernels"] > 0
    assert modes["ping_pong"]["kernels"] > modes["serial"]["kernels"]
    assert (
        modes["ping_pong"]["sent_gib"] >= modes["serial"]["sent_gib"] > 1000 * modes["signal"]["sent_gib"] > 0
    )
    calls = res["timeline"]["ping_pong"]["calls"]
    assert [(c["pass"], c["call"]) for c in calls] == [("fwd", 0), ("fwd", 1), ("bwd", 0), ("bwd", 1)]
    assert all(c["stages"][:2] == ["dispatch.0", "dispatch.1"] for c in calls)
    report = (tmp_path / "pp.md").read_text()
    assert report.count("| smoke / 1K") == len(modes) and "### Timeline: smoke / 1K, ping_pong" in report
    assert (tmp_path / "traces" / "smoke_1024_ping_pong_gloo.json.gz").stat().st_size > 1000
