"""core_attention on 2 and 4 gloo processes against the single-process oracle.

One spawn per world size; every case runs inside it (spawning costs seconds). Each rank returns its
outputs, the gradients of loss = sum(out * w) (w sliced per rank from one global tensor) and the
engine metrics; the parent compares them with
- the oracle (plain per-document attention, float64) on the concatenated documents, and
- an exact replay of the plan: the reference kernel run per CA-task in this process, which the engine
  must reproduce bit for bit (it only moves rows around that kernel),
and checks the plan really moved work, the metrics (FLOPs, kernel runs, bytes of every exchange)
against the plan, that the stages called one by one with asynchronous exchanges give bit for bit the
operator's results, and that malformed pieces fail on every rank. Inputs that differ between ranks are
tested in test_engine_consistency.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import check_cases, run_distributed
from engine_bytes import exchange_bytes, nonzero, phase_counts
from oracle import TOL, Layout, assert_close, named_layouts, oracle_with_grads, random_qkv
from test_engine_remat import check_remat_case, remat_case

from hf_distca import DistCAConfig, PieceError, core_attention, metrics, plan_core_attention
from hf_distca import engine as eng
from hf_distca.engine import engine_state
from hf_distca.kernels import ForwardTensors, reference_varlen_attention
from hf_distca.planning import attention_flops_per_pair, build_dispatch_index, forward_flops_per_pair, traffic
from hf_distca.planning.ping_pong import part_plans
from hf_distca.planning.relay import relay_kv_bytes

D = 8
HEADS = {"gqa": (4, 2), "mha": (3, 3)}
PRICED = DistCAConfig(shard_tokens=8, tolerance=0.3, link_gib_per_s=0.02, intra_node_gib_per_s=0.2, ranks_per_node=2,
                      attention_tflops=1e-3, backend="reference")  # fmt: skip
DTYPES = {"fp64": torch.float64, "fp32": torch.float32}
SPAWN_TIMEOUT = 150  # seconds; a hang (e.g. one rank raising alone) fails instead of blocking the suite


# ------------------------------------------------------------------------------------ worker (ranks)
def _attention_case(rank: int, case: dict) -> dict:
    layout: Layout = case["layout"]
    hq, hkv = HEADS[case["heads"]]
    q_all, k_all, v_all, w_all = random_qkv(layout.total, hq, hkv, D, DTYPES[case["dtype"]], case["seed"])
    rows = torch.as_tensor(layout.rows(rank))
    q, k, v = (t[rows].clone().requires_grad_(True) for t in (q_all, k_all, v_all))
    all_pieces = case.get("all_pieces", {}).get(rank)
    engine_state().reset()
    metrics.reset()
    saved_bytes: list[int] = []  # what autograd keeps from forward to backward, per call

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved_bytes.append(t.numel() * t.element_size())
        return t

    for _ in range(case.get("repeat", 1)):  # "layers": the plan is made once and reused
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = core_attention(
                q, k, v, layout.pieces[rank], config=case["config"], all_pieces=all_pieces,
                window=case.get("window"),
            )  # fmt: skip
    forward = metrics.snapshot()
    lse_shape = tuple(out.grad_fn.lse.shape)  # the operator's context: the server's log-sum-exp
    (out * w_all[rows]).sum().backward()
    return {
        "out": out.detach(),
        "dq": q.grad,
        "dk": k.grad,
        "dv": v.grad,
        "forward": forward,
        "total": metrics.snapshot(),
        "saved_bytes": sum(saved_bytes),
        "lse_shape": lse_shape,
    }


def _stages_case(rank: int, case: dict) -> dict:
    """The stages one by one, every exchange asynchronous, vs the operator: identical bits."""
    layout: Layout = case["layout"]
    hq, hkv = HEADS[case["heads"]]
    q_all, k_all, v_all, w_all = random_qkv(layout.total, hq, hkv, D, DTYPES[case["dtype"]], case["seed"])
    rows = torch.as_tensor(layout.rows(rank))
    q, k, v, w = (t[rows].clone() for t in (q_all, k_all, v_all, w_all))
    cfg, group = case["config"], dist.group.WORLD
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = core_attention(*leaves, layout.pieces[rank], config=cfg, all_pieces=layout.pieces)
    out.backward(w)
    prep = eng.prepare(q, k, v, layout.pieces[rank], group=group, config=cfg, all_pieces=layout.pieces)
    pending = eng.dispatch(prep, q, k, v, group, async_op=True)
    kernel = eng.Kernel(None, cfg.backend)
    out_k, lse = eng.compute(prep, q, k, v, pending.wait(), kernel)
    pending = eng.return_outputs(prep, out_k, group, async_op=True)
    staged = eng.gather_outputs(prep, out_k, pending.wait())
    pending = eng.dispatch_backward(prep, q, k, v, staged, w, group, async_op=True)
    grads_k = eng.compute_backward(prep, ForwardTensors(q, k, v, staged, lse), w, pending.wait(), kernel)
    dq_k, dk_k, dv_k, _ = grads_k  # no sinks: no sinks gradient
    grads = eng.gather_grads(prep, eng.return_grads(prep, dq_k, dk_k, dv_k, group, async_op=True), k.dtype)
    return {"op": [out.detach(), *(t.grad for t in leaves)], "stages": [staged, *grads]}


def _engine_worker(rank: int, world: int, cases: list[dict]) -> list[dict]:
    results = []
    for case in cases:
        try:
            if case["kind"] == "attention":
                results.append(_attention_case(rank, case))
            elif case["kind"] == "stages":
                results.append(_stages_case(rank, case))
            elif case["kind"] == "remat":
                results.append(remat_case(rank, world))
            else:  # malformed input: only the raised error matters
                q = torch.zeros(case["tokens"][rank], 2, D)
                k = torch.zeros(case["tokens"][rank], 1, D)
                all_pieces = case.get("all_pieces", {}).get(rank)
                core_attention(q, k, k, case["pieces"][rank], config=case["config"], all_pieces=all_pieces)
                results.append({"error": None})
        except Exception as err:  # noqa: BLE001 - reported to the parent, which asserts on it
            results.append({"error": type(err).__name__, "message": str(err)})
    return results


# --------------------------------------------------------------------------------------------- cases
def _attention_cases(world: int) -> list[dict]:
    cases = []
    for i, layout in enumerate(named_layouts(world, seed=11)):
        for combo, (heads, dtype) in enumerate(
            [("gqa", "fp64"), ("mha", "fp32"), ("mha", "fp64"), ("gqa", "fp32")]
        ):
            shard = 8 if combo % 2 == 0 else 16
            tol = 0.1
            if layout.name == "giant":  # balance reachable: shard x longest doc < tol x mean load
                shard, tol = 8, 0.3
            config = DistCAConfig(shard_tokens=shard, tolerance=tol, backend="reference")
            cases.append(
                {"kind": "attention", "layout": layout, "heads": heads, "dtype": dtype, "seed": 100 * i + combo,
                 "config": config}
            )  # fmt: skip
    giant = next(c["layout"] for c in cases if c["layout"].name == "giant")
    # three layers with one plan; pieces passed by the caller
    cases.append(
        {"kind": "attention", "name": "repeat", "layout": giant, "heads": "gqa", "dtype": "fp64", "seed": 5,
         "repeat": 3, "config": DistCAConfig(shard_tokens=8, tolerance=0.3)}
    )  # fmt: skip
    # the stages called one by one with asynchronous exchanges
    cases.append(
        {"kind": "stages", "name": "stages", "layout": giant, "heads": "gqa", "dtype": "fp32", "seed": 4,
         "config": DistCAConfig(shard_tokens=8, tolerance=0.3, backend="reference")}
    )  # fmt: skip
    cases.append(
        {"kind": "attention", "name": "all_pieces", "layout": giant, "heads": "mha", "dtype": "fp32", "seed": 6,
         "all_pieces": dict.fromkeys(range(world), giant.pieces), "config": DistCAConfig(shard_tokens=16)}
    )  # fmt: skip
    # communication-aware planning (slow links, nodes of 2 ranks): with 4 ranks a plan other than the
    # balance-only one, still exact
    cases.append(
        {"kind": "attention", "name": "priced", "layout": giant, "heads": "gqa", "dtype": "fp64", "seed": 7,
         "config": PRICED}
    )  # fmt: skip
    # no move at all (huge tolerance): the rank without tokens has no task either; with 4 ranks documents
    # span ranks, so KV still travels and the idle rank must join both exchanges, forward and backward
    empty = next(c["layout"] for c in cases if c["layout"].name == "empty_rank")
    cases.append(
        {"kind": "attention", "name": "idle_server", "layout": empty, "heads": "gqa", "dtype": "fp64", "seed": 8,
         "config": DistCAConfig(shard_tokens=8, tolerance=9.0)}
    )  # fmt: skip
    # balanced and every document local: nothing is exchanged at all
    local = Layout("local_only", list(range(2 * world)), [13, 30] * world,
                   [[(2 * r, 0, 13), (2 * r + 1, 0, 30)] for r in range(world)])  # fmt: skip
    cases.append(
        {"kind": "attention", "name": "local_only", "layout": local, "heads": "mha", "dtype": "fp32", "seed": 9,
         "config": DistCAConfig(shard_tokens=8)}
    )  # fmt: skip
    # sliding-window layers: documents far longer than the window cut over ranks; shards whose window
    # starts inside another rank's piece; window 1 (each query sees only itself); ping-pong nano-batches
    spans = next(c["layout"] for c in cases if c["layout"].name == "spans")
    for name, layout, window, dtype, config in (
        ("window_giant", giant, 16, "fp64", DistCAConfig(shard_tokens=8, tolerance=0.3, backend="reference")),
        ("window_spans", spans, 7, "fp32", DistCAConfig(shard_tokens=8, backend="reference")),
        ("window_one", giant, 1, "fp64", DistCAConfig(shard_tokens=8, tolerance=0.3)),
        ("window_ping_pong", giant, 24, "fp64", DistCAConfig(shard_tokens=8, tolerance=0.3, ping_pong=True)),
        ("window_priced", giant, 32, "fp64", PRICED),
    ):
        cases.append(
            {"kind": "attention", "name": name, "layout": layout, "heads": "gqa", "dtype": dtype, "seed": 12,
             "window": window, "config": config}
        )  # fmt: skip
    if world == 4:  # the KV relay over 2 nodes of 2 ranks: serial, ping-pong, a window; the stages one by one
        relay = {"shard_tokens": 8, "tolerance": 0.3, "ranks_per_node": 2, "kv_relay": True}
        for name, layout, heads, dtype, window, config in (
            ("relay_giant", giant, "gqa", "fp64", None, DistCAConfig(**relay, backend="reference")),
            ("relay_spans", spans, "mha", "fp32", None, DistCAConfig(**relay)),
            ("relay_ping_pong", giant, "gqa", "fp64", None, DistCAConfig(**relay, ping_pong=True)),
            ("relay_window", giant, "gqa", "fp64", 16, DistCAConfig(**relay)),
        ):
            cases.append(
                {"kind": "attention", "name": name, "layout": layout, "heads": heads, "dtype": dtype, "seed": 13,
                 "window": window, "config": config}
            )  # fmt: skip
        cases.append(
            {"kind": "stages", "name": "relay_stages", "layout": giant, "heads": "gqa", "dtype": "fp32", "seed": 4,
             "config": DistCAConfig(**relay, backend="reference")}
        )  # fmt: skip
    return cases


def _error_cases(world: int) -> list[dict]:
    """Malformed pieces, identical on every rank: every rank must raise the planner's error."""
    rest = [[(10 + r, 0, 4)] for r in range(2, world)]  # other ranks hold valid pieces
    tokens = [10, 10] + [4] * (world - 2)
    cfg = DistCAConfig(shard_tokens=8)
    return [
        {"kind": "error", "name": "overlap", "pieces": [[(0, 0, 10)], [(0, 5, 10)], *rest], "tokens": tokens,
         "config": cfg, "expect": ("PieceError", "held twice")},
        {"kind": "error", "name": "gap", "pieces": [[(0, 0, 10)], [(0, 12, 10)], *rest], "tokens": tokens,
         "config": cfg, "expect": ("PieceError", "gap")},
        {"kind": "error", "name": "negative", "pieces": [[(0, 0, 10)], [(1, -2, 10)], *rest], "tokens": tokens,
         "config": cfg, "expect": ("PieceError", "negative field")},
    ]  # fmt: skip


# ------------------------------------------------------------------------------------ parent checks
def _exact_replay(layout: Layout, plan, q_all, k_all, v_all) -> torch.Tensor:
    """Every CA-task of the plan through the reference kernel, one task at a time, in this process (a
    task of a window-W layer over keys [max(0, q_start - W + 1), q_end))."""
    out = torch.full_like(q_all, float("nan"))
    offsets = layout.offsets()
    for tasks in plan.tasks:
        for t in tasks:
            base = offsets[t.doc_id]
            first = 0 if plan.window is None else max(0, t.q_start - plan.window + 1)
            qs = q_all[base + t.q_start : base + t.q_end]
            ks, vs = k_all[base + first : base + t.q_end], v_all[base + first : base + t.q_end]
            cu_q = torch.tensor([0, t.q_len], dtype=torch.int32)
            cu_k = torch.tensor([0, t.q_end - first], dtype=torch.int32)
            out[base + t.q_start : base + t.q_end] = reference_varlen_attention(
                qs, ks, vs, cu_q, cu_k, t.q_len, t.q_end - first, scale=D**-0.5, window=plan.window
            )
    return out


def _exchange_bytes(plan, rank: int, q_row: int, kv_row: int) -> dict[str, int]:
    """Bytes one engine call moves for ``rank``: the ledger's phases over the rows of its dispatch index."""
    ix = build_dispatch_index(plan, rank)
    counts = (sum(ix.send_q_counts), sum(ix.send_kv_counts), sum(ix.recv_q_counts), sum(ix.recv_kv_counts))
    return exchange_bytes(*counts, q_row, kv_row)


def _check_stages_case(case: dict, per_rank: list[dict], world: int) -> None:
    for rank, res in enumerate(per_rank):
        assert res.get("error") is None, f"stages rank {rank}: {res}"
        for name, got, want in zip(("out", "dq", "dk", "dv"), res["stages"], res["op"], strict=True):
            assert_close(got, want, "exact", f"stages/world={world} rank {rank} {name}")


def _check_attention_case(case: dict, per_rank: list[dict], world: int) -> dict:
    layout: Layout = case["layout"]
    hq, hkv = HEADS[case["heads"]]
    dtype = DTYPES[case["dtype"]]
    label = f"{case.get('name', layout.name)}/{case['heads']}/{case['dtype']}/world={world}"
    q_all, k_all, v_all, w_all = random_qkv(layout.total, hq, hkv, D, dtype, case["seed"])
    window = case.get("window")
    ref = oracle_with_grads(q_all, k_all, v_all, w_all, layout.doc_lens, window=window)
    if window is not None:  # the window cuts these documents: the case is not plain causal attention
        causal = oracle_with_grads(q_all, k_all, v_all, w_all, layout.doc_lens)
        assert (causal[0] - ref[0]).abs().max() > 0.1, label
    elem = q_all.element_size()
    plan = plan_core_attention(
        layout.pieces, q_row_bytes=hq * D * elem, kv_row_bytes=2 * hkv * D * elem, options=case["config"].planner_options(),
        flops_per_pair=attention_flops_per_pair(hq, D), window=window,
    )  # fmt: skip
    exact = _exact_replay(layout, plan, q_all, k_all, v_all)
    repeat = case.get("repeat", 1)
    flops_per_pair = forward_flops_per_pair(hq, D)
    for rank, res in enumerate(per_rank):
        assert res.get("error") is None, f"{label} rank {rank}: {res}"
        rows = torch.as_tensor(layout.rows(rank))
        for name, got, want in zip(
            ("out", "dq", "dk", "dv"), (res["out"], res["dq"], res["dk"], res["dv"]), ref
        ):
            assert got.dtype == dtype and got.shape[0] == len(rows)
            assert_close(got, want[rows], case["dtype"], f"{label} rank {rank} {name}")
        cfg = case["config"]
        if cfg.ping_pong:  # nano-batches cut the plan's tasks: oracle, and each part's bytes the ledger's
            parts = part_plans(plan, cfg.shard_tokens, cfg.ping_pong_split)
            relay = cfg.ranks_per_node if cfg.kv_relay else None
            ledger = sum(traffic.plan_bytes(part, relay) for part in parts)
            assert nonzero(res["total"].phase_bytes) == phase_counts(ledger, rank, 1, 1), label
            continue
        assert_close(res["out"], exact[rows], "exact", f"{label} rank {rank} out vs replay")
        # metrics: per-server FLOPs of the plan; one forward kernel per call on a server with tasks; bytes
        # as counted by comm.py, per exchange (forward = the planner's own traffic estimate)
        fwd, total = res["forward"], res["total"]
        assert (fwd.calls, fwd.plans, total.calls) == (repeat, 1, repeat), label
        assert fwd.flops_before == [repeat * flops_per_pair * x for x in plan.load_before], label
        assert fwd.flops_after == [repeat * flops_per_pair * x for x in plan.load_after], label
        # memory: per call, autograd keeps this rank's q, k, v and output (local rows only, nothing the
        # server received) and the context the server's log-sum-exp, one row per query row it computes
        local_bytes = len(rows) * (2 * hq + 2 * hkv) * D * elem
        assert res["saved_bytes"] == repeat * local_bytes, label
        assert res["lse_shape"] == (sum(t.q_len for t in plan.tasks[rank]), hq), label
        serves = any(t.q_len for t in plan.tasks[rank])
        assert (fwd.attn_fwd_kernels, total.attn_fwd_kernels) == (repeat * serves, repeat * serves), label
        relay = case["config"].ranks_per_node if case["config"].kv_relay else None
        if relay is None:  # the planner's bytes are the direct route's
            want = _exchange_bytes(plan, rank, hq * D * elem, 2 * hkv * D * elem)
            assert (want["fwd_sent"], want["fwd_recv"]) == (
                plan.bytes_sent[rank],
                plan.bytes_received[rank],
            ), label
            assert (fwd.bytes_sent, fwd.bytes_received) == (
                repeat * want["fwd_sent"],
                repeat * want["fwd_recv"],
            ), label
            assert total.bytes_sent == repeat * want["fwd_sent"] + want["bwd_sent"], label
            assert total.bytes_received == repeat * want["fwd_recv"] + want["bwd_recv"], label
        # phase by phase, the engine's measured bytes are the traffic ledger's (both stages with the relay)
        ledger = traffic.plan_bytes(plan, relay)
        assert nonzero(fwd.phase_bytes) == phase_counts(ledger, rank, repeat, 0), label
        assert nonzero(total.phase_bytes) == phase_counts(ledger, rank, repeat, 1), label
    cfg = case["config"]
    mean = sum(plan.load_before) / world
    achievable = cfg.shard_tokens * max(layout.doc_lens) < cfg.balance_tolerance * mean  # see test_planner
    if achievable and cfg.link_gib_per_s is None:  # a priced plan balances only as far as it pays
        assert plan.imbalance_after <= (1 + cfg.balance_tolerance) * (1 + TOL["balance"][0]), label
    return {"name": case.get("name", layout.name), "moves": plan.moves, "moved": plan.load_after != plan.load_before,
            "achievable": achievable, "bytes": sum(plan.bytes_sent),
            "relayed": bool(cfg.kv_relay and relay_kv_bytes(plan, 1, cfg.ranks_per_node)[1].sum()),
            "exchanges": sum(res["total"].exchanges for res in per_rank)}  # fmt: skip


def _check_error_case(case: dict, per_rank: list[dict], world: int) -> None:
    cls, pattern = case["expect"]
    for rank, res in enumerate(per_rank):
        where = f"{case['name']} rank {rank}: {res}"
        assert res["error"] == cls, where
        if pattern:
            assert pattern in res["message"], where


@pytest.mark.parametrize("world", [2, 4])
def test_engine_distributed_and_remat(world):
    """The engine cases above, then a tiny Llama step with rematerialization-aware checkpointing vs no
    checkpointing vs plain recompute (test_engine_remat.py) in the same processes."""
    attention = _attention_cases(world)
    errors = _error_cases(world)
    # errors in the middle: the group must still work after every rank raised
    cases = attention[:4] + errors + attention[4:] + [{"kind": "remat"}]
    results = run_distributed(_engine_worker, world, cases, timeout=SPAWN_TIMEOUT)
    checks = {
        "attention": lambda case, per_rank: _check_attention_case(case, per_rank, world),
        "stages": lambda case, per_rank: _check_stages_case(case, per_rank, world),
        "remat": lambda case, per_rank: check_remat_case(per_rank, world),
        "error": lambda case, per_rank: _check_error_case(case, per_rank, world),
    }
    summaries = check_cases(cases, results, checks)["attention"]
    # the engine really moved work: not a test that passes because nothing moved
    by_name = {}
    for s in summaries:
        by_name.setdefault(s["name"], []).append(s)
    assert all(s["moves"] > 0 and s["moved"] and s["bytes"] > 0 for s in by_name["giant"])
    assert all(s["achievable"] for s in by_name["giant"])  # so the balance assertion ran there
    moving = [(s["name"], s["moves"]) for s in summaries]
    assert sum(m > 0 for _, m in moving) >= len(moving) // 2, moving
    # and the two special cases are what they claim to be
    # (with 2 ranks the other rank holds every document: no exchange, the idle rank's k/v must still get
    # zero gradients, not None; with 4, documents span the 3 busy ranks: KV travels without any move)
    assert by_name["idle_server"][0]["moves"] == 0 and (by_name["idle_server"][0]["bytes"] > 0) == (world > 2)
    assert by_name["local_only"][0]["moves"] == 0 and by_name["local_only"][0]["bytes"] == 0
    assert by_name["priced"][0]["moves"] > 0
    assert all(
        by_name[n][0]["moves"] > 0 and by_name[n][0]["bytes"] > 0 for n in ("window_giant", "window_one")
    )
    relayed = {s["name"]: s["relayed"] for s in summaries if s["name"].startswith("relay_")}
    assert (sorted(relayed) == ["relay_giant", "relay_ping_pong", "relay_spans", "relay_window"]) == (
        world == 4
    )
    assert all(relayed.values()), relayed  # the relays forwarded rows inside their node: a second stage ran
    if world == 4:  # the priced plan the engine ran is not the balance-only one
        giant = next(c["layout"] for c in attention if c.get("name") == "priced")
        hq, hkv = HEADS["gqa"]
        rows = {"q_row_bytes": hq * D * 8, "kv_row_bytes": 2 * hkv * D * 8}
        priced = plan_core_attention(
            giant.pieces,
            options=PRICED.planner_options(),
            flops_per_pair=attention_flops_per_pair(hq, D),
            **rows,
        )
        balance_only = plan_core_attention(
            giant.pieces, options=DistCAConfig(shard_tokens=8, tolerance=0.3).planner_options(), **rows
        )
        assert (
            priced.digest() != balance_only.digest()
            and priced.critical_path_after < priced.critical_path_before
        )


def test_piece_error_is_a_value_error():
    assert issubclass(PieceError, ValueError)
