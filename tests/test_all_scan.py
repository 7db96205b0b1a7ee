"""Sequence-parallel linear attention (hf_distca.linear): the state scan across ranks and a hybrid model.

CPU-only, gloo. Each distributed test spawns once per world size and runs every case inside:
- op level: ``linear_attention`` for every transition kind (no decay, per-head constant, per-head per
  token, per key-dim, delta rule, Kimi delta rule) x every scan method (all_scan, serial, all_gather) x
  two layouts (DistCA's zigzag layout from ``layout_pieces``, and contiguous chunks with documents
  starting and ending inside ranks), outputs and input gradients against a per-token float64 oracle
  on the uncut documents; local backend 'reference', and 'chunked' for every kind under All-Scan;
- model level: a tiny MiniMax (lightning attention + softmax attention, MoE) with documents cut across
  ranks by ``DistCABatches``: softmax layers through attn_implementation="distca", linear layers
  through the scan; the loss and every parameter gradient (summed over ranks) against Transformers'
  own unmodified model run document by document in one process.
"""

from __future__ import annotations

import pytest
import torch
from all_scan_cases import (
    KINDS,
    doc_lengths_of,
    minimax_documents,
    oracle,
    per_token,
    random_inputs,
    rank_rows,
    tiny_minimax,
)
from distributed import run_distributed
from tolerances import TOL

from hf_distca.data import layout_pieces
from hf_distca.linear import LinearSPConfig, build_scan_plan, linear_attention
from hf_distca.linear.ops import chains_of, recurrence
from hf_distca.planning import PieceError

SCALE = 0.5
METHODS = ("all_scan", "serial", "all_gather")
SPAWN_TIMEOUT = 240


def chunked_layout(doc_lengths: list[int], world: int) -> list[list[tuple[int, int, int]]]:
    """Documents back to back, cut into ``world`` equal consecutive chunks (ZeCO's / LASP's layout)."""
    total = sum(doc_lengths)
    per_rank = total // world
    assert per_rank * world == total
    layout: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    pos = 0
    for doc, n in enumerate(doc_lengths):
        start = 0
        while start < n:
            rank = pos // per_rank
            take = min(n - start, (rank + 1) * per_rank - pos)
            layout[rank].append((doc, start, take))
            start += take
            pos += take
    return layout


LAYOUTS = {
    2: {
        "zigzag": [list(p) for p in layout_pieces([150, 40, 23, 7], world_size=2, tokens_per_rank=115)],
        "chunks": chunked_layout([70, 35, 55, 20], 2),
        # one document dealt round-robin in 6 pieces: a chain 0 -> 1 -> 0 -> 1 -> 0 -> 1 (5 hops, 3 pieces a rank)
        "alternating": [
            [(0, 0, 20), (0, 40, 25), (0, 85, 15), (1, 0, 10)],
            [(0, 20, 20), (0, 65, 20), (0, 100, 30)],
        ],
    },
    4: {
        "zigzag": [list(p) for p in layout_pieces([200, 17, 13, 9], world_size=4, tokens_per_rank=62)],
        "chunks": chunked_layout([100, 35, 5, 20], 4),
    },
}
MODEL_DOCS = {2: ([130, 30, 20], 96), 4: ([130, 30, 20], 48)}  # (document lengths, tokens per rank)


# ------------------------------------------------------------------------------------ worker (ranks)
def _op_case(rank: int, case: dict, group=None, group_rank: int | None = None) -> dict:
    all_pieces = case["layout"]
    my_rank = rank if group_rank is None else group_rank
    total = sum(doc_lengths_of(all_pieces))
    inputs = random_inputs(case["kind"], total, case["seed"], case["dtype"])
    rows = rank_rows(all_pieces, my_rank)
    local = {}
    for name in ("q", "k", "v", "log_decay", "beta"):
        x = inputs[name]
        if x is None:
            local[name] = None
            continue
        local[name] = (x[rows] if per_token(x, total) else x).clone().requires_grad_(True)
    config = LinearSPConfig(backend=case["backend"], scan=case["method"], num_blocks=case["blocks"])
    out = linear_attention(
        local["q"],
        local["k"],
        local["v"],
        all_pieces[my_rank],
        log_decay=local["log_decay"],
        beta=local["beta"],
        scale=SCALE,
        group=group,
        all_pieces=all_pieces,
        config=config,
    )
    (out * inputs["w"][rows]).sum().backward()
    # the same pieces without the scan: how much the state from other pieces changes the result
    lengths = [n for _, _, n in all_pieces[my_rank]]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    alone, _ = recurrence(
        *(local[n].detach() for n in ("q", "k", "v")),
        cu_seqlens=cu,
        log_decay=None if local["log_decay"] is None else local["log_decay"].detach(),
        beta=None if local["beta"] is None else local["beta"].detach(),
        scale=SCALE,
        backend="reference",
    )
    result = {"out": out.detach(), "scan_effect": float((out.detach() - alone).abs().max())}
    for name, x in local.items():
        result["d" + name] = None if x is None else x.grad
    return result


def _model_case(rank: int, world: int, case: dict) -> dict:
    import hf_distca
    from hf_distca.data import DistCABatches
    from hf_distca.linear.layers import enable_linear_attention_sp

    docs = minimax_documents(case["doc_lengths"], case["seed"])
    batches = DistCABatches(docs, rank=rank, world_size=world, tokens_per_rank=case["tokens_per_rank"])
    batch = batches.micro_batch(docs)
    model = tiny_minimax("distca")
    hf_distca.enable_distca(model, group=None, config=hf_distca.DistCAConfig(shard_tokens=16))
    replaced = enable_linear_attention_sp(model, group=None, config=LinearSPConfig(backend="reference"))
    if case["checkpointing"]:
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
        model.train()
    global_targets = sum(len(d) - 1 for d in docs)
    out = model(**batch, num_items_in_batch=global_targets)
    out.loss.backward()
    return {
        "loss": out.loss.detach(),
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None},
        "replaced": replaced,
        "all_pieces": batch["distca_layout"].all_pieces,
    }


def _worker(rank: int, world: int, op_cases: list[dict], model_cases: list[dict], subgroup_cases: list[dict]):
    import torch.distributed as dist

    ops = [_op_case(rank, case) for case in op_cases]
    # a subgroup without rank 0: peers are addressed by their global ranks
    members = list(range(1, world))
    group = dist.new_group(members)
    sub = []
    if rank in members:
        sub = [_op_case(rank, case, group=group, group_rank=members.index(rank)) for case in subgroup_cases]
    dist.barrier()
    models = [_model_case(rank, world, case) for case in model_cases]
    return {"ops": ops, "sub": sub, "models": models}


# --------------------------------------------------------------------------------------- parent side
def _op_cases(world: int) -> list[dict]:
    cases = []
    for layout_name, layout in LAYOUTS[world].items():
        for kind in KINDS:
            for method in METHODS:
                cases.append(
                    dict(
                        layout=layout,
                        layout_name=layout_name,
                        kind=kind,
                        method=method,
                        blocks=4,
                        dtype=torch.float64,
                        seed=100 + 10 * KINDS.index(kind) + len(layout_name),
                        backend="reference",
                    )
                )
    for kind in KINDS:  # the chunked local backend under the scan (its own pieces' chunks)
        cases.append(
            dict(
                layout=LAYOUTS[world]["zigzag"],
                layout_name="zigzag",
                kind=kind,
                method="all_scan",
                blocks=4,
                dtype=torch.float64,
                seed=100 + 10 * KINDS.index(kind) + len("zigzag"),
                backend="chunked",
            )
        )
    for kind in ("scalar", "delta"):  # float32 inputs against the float64 oracle
        layout = LAYOUTS[world]["zigzag"]
        cases.append(
            dict(
                layout=layout,
                layout_name="zigzag",
                kind=kind,
                method="all_scan",
                blocks=16,
                dtype=torch.float32,
                seed=7,
                backend="chunked" if kind == "delta" else "reference",
            )
        )
    return cases


def _oracle_with_grads(case: dict) -> dict:
    lengths = doc_lengths_of(case["layout"])
    inputs = random_inputs(case["kind"], sum(lengths), case["seed"], torch.float64)
    leaves = {n: (x.clone().requires_grad_(True) if x is not None else None) for n, x in inputs.items()}
    out = oracle(leaves, lengths, SCALE)
    (out * inputs["w"]).sum().backward()
    return {"out": out.detach(), **{"d" + n: (x.grad if x is not None else None) for n, x in leaves.items()}}


def _check_ops(world: int, cases: list[dict], results: list[list[dict]], oracles: dict) -> None:
    for index, case in enumerate(cases):
        key = (case["layout_name"], case["kind"], case["seed"], len(case["layout"]))
        if key not in oracles:
            oracles[key] = _oracle_with_grads(case)
        ref = oracles[key]
        tol = "linear_fp64" if case["dtype"] == torch.float64 else "fp32"
        label = (
            f"{world} ranks, {case['layout_name']}, {case['kind']}, {case['method']}, {case['dtype']}, "
            f"{case['backend']}"
        )
        total = ref["out"].shape[0]
        summed = {}
        for rank, per_rank in enumerate(results):
            got = per_rank[index]
            rows = rank_rows(case["layout"], rank)
            assert_close(got["out"], ref["out"][rows], tol, f"{label}: out, rank {rank}")
            for name in ("dq", "dk", "dv", "dlog_decay", "dbeta"):
                want = ref[name]
                if want is None:
                    assert got[name] is None
                elif per_token(want, total):
                    assert_close(got[name], want[rows], tol, f"{label}: {name}, rank {rank}")
                else:  # a parameter shared by all ranks: its gradient is the sum over ranks
                    summed[name] = summed.get(name, 0) + got[name].double()
        for name, value in summed.items():
            assert_close(value, ref[name], tol, f"{label}: {name} summed over ranks")
        # the layout cuts documents and their continuation changes the outputs (the test can fail)
        assert max(r[index]["scan_effect"] for r in results) > 1e-2, label


def _check_model(world: int, case: dict, results: list[dict]) -> None:
    assert all(r["replaced"] == 2 for r in results)
    all_pieces = results[0]["all_pieces"]
    assert chains_of(all_pieces), "the model layout must cut a document across ranks"
    docs = minimax_documents(case["doc_lengths"], case["seed"])
    ref_model = tiny_minimax("sdpa")  # Transformers' own modules, one document at a time
    global_targets = sum(len(d) - 1 for d in docs)
    loss = 0
    for doc in docs:
        ids = torch.tensor(doc)[None]
        logits = ref_model(input_ids=ids).logits[0, :-1].double()
        loss = loss + torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")
    loss = loss / global_targets
    loss.backward()
    label = f"MiniMax, {world} ranks, checkpointing={case['checkpointing']}"
    total_loss = sum(r["loss"] for r in results)
    loss = loss.detach()
    rtol = TOL["train_loss"][0]
    assert abs(float(total_loss) - float(loss)) <= rtol * abs(float(loss)), (label, total_loss, loss)
    for name, param in ref_model.named_parameters():
        want = param.grad
        got = sum(r["grads"][name] for r in results)
        rtol, floor = TOL["grads"]
        torch.testing.assert_close(
            got, want, rtol=rtol, atol=floor * float(want.abs().max()), msg=f"{label}: {name}"
        )


@pytest.mark.parametrize("world", [2, 4])
def test_all_scan_ops_and_minimax_exact_across_ranks(world):
    op_cases = _op_cases(world)
    sub_world = world - 1
    subgroup_cases = (
        [
            dict(
                layout=chunked_layout([40, 20, 30], sub_world),
                layout_name=f"chunks{sub_world}",
                kind=kind,
                method=method,
                blocks=3,
                dtype=torch.float64,
                seed=11,
                backend="reference",
            )
            for kind in ("delta", "vector")
            for method in METHODS
        ]
        if sub_world > 1
        else []
    )
    model_cases = [
        dict(
            doc_lengths=MODEL_DOCS[world][0],
            tokens_per_rank=MODEL_DOCS[world][1],
            seed=5,
            checkpointing=world == 4,
        )
    ]
    results = run_distributed(_worker, world, op_cases, model_cases, subgroup_cases, timeout=SPAWN_TIMEOUT)
    oracles: dict = {}
    _check_ops(world, op_cases, [r["ops"] for r in results], oracles)
    if subgroup_cases:
        _check_ops(sub_world, subgroup_cases, [r["sub"] for r in results[1:]], oracles)
    _check_model(world, model_cases[0], [r["models"][0] for r in results])


def assert_close(actual, expected, kind: str, msg: str) -> None:
    rtol, atol = TOL[kind]
    torch.testing.assert_close(
        actual, expected.to(actual.dtype), rtol=rtol, atol=atol, msg=lambda m: f"{msg}: {m}"
    )


# ------------------------------------------------------------------------------ single process (no spawn)
@pytest.mark.parametrize("kind", KINDS)
def test_all_scan_reference_recurrence_matches_oracle(kind):
    """The batched per-token loop (CPU backend) equals the one-document oracle, outputs and gradients."""
    lengths = [13, 1, 7, 20]
    inputs = random_inputs(kind, sum(lengths), seed=3)
    leaves = {n: (x.clone().requires_grad_(True) if x is not None else None) for n, x in inputs.items()}
    cu = [0, 13, 14, 21, 41]
    out, final = recurrence(
        leaves["q"],
        leaves["k"],
        leaves["v"],
        cu_seqlens=cu,
        log_decay=leaves["log_decay"],
        beta=leaves["beta"],
        scale=SCALE,
        output_final_state=True,
        backend="reference",
    )
    (out * inputs["w"]).sum().backward()
    ref_leaves = {n: (x.clone().requires_grad_(True) if x is not None else None) for n, x in inputs.items()}
    ref = oracle(ref_leaves, lengths, SCALE)
    (ref * inputs["w"]).sum().backward()
    assert_close(out, ref, "linear_fp64", kind)
    for name, x in leaves.items():
        if x is not None and name != "w":
            assert_close(x.grad, ref_leaves[name].grad, "linear_fp64", f"{kind}: d{name}")
    assert final.shape == (4, 2, 4, 6)


def test_all_scan_reference_matches_transformers_delta_rule_and_closed_form():
    """Independent checks: Transformers' own gated-delta-rule loop, and the quadratic (parallel) form of
    decayed linear attention o_i = sum_{j<=i} exp(G_i - G_j) (q_i . k_j) v_j."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    inputs = random_inputs("delta", 30, seed=4, dtype=torch.float32)
    q, k, v, g, beta = (inputs[n] for n in ("q", "k", "v", "log_decay", "beta"))
    ours, final = recurrence(
        q,
        k,
        v,
        cu_seqlens=[0, 30],
        log_decay=g,
        beta=beta,
        scale=K_SCALE,
        output_final_state=True,
        backend="reference",
    )
    theirs, their_final = torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g=g[None], beta=beta[None], output_final_state=True
    )
    assert_close(ours, theirs[0], "fp32", "delta rule vs Transformers")
    assert_close(final, their_final, "fp32", "final state vs Transformers")

    inputs = random_inputs("scalar", 25, seed=5)
    q, k, v, g = (inputs[n] for n in ("q", "k", "v", "log_decay"))
    ours, _ = recurrence(q, k, v, cu_seqlens=[0, 25], log_decay=g, scale=SCALE, backend="reference")
    cum = g.cumsum(0)  # (T, H)
    causal = torch.ones(25, 25, dtype=g.dtype).tril()[:, :, None]  # (T, T, 1): key j <= query i
    decay = (cum[:, None, :] - cum[None, :, :]).exp() * causal  # (T, T, H)
    scores = torch.einsum("ihk,jhk->ijh", q, k) * decay  # (T, T, H)
    closed = torch.einsum("ijh,jhv->ihv", scores, v) * SCALE
    assert_close(ours, closed, "linear_fp64", "parallel form")


K_SCALE = 4**-0.5  # Transformers' delta-rule loop scales queries by 1/sqrt(K) (K = 4)


def test_all_scan_single_process_pieces_out_of_order():
    """One process holding a document in three non-adjacent pieces: the hops are local copies and the
    result still equals the uncut document, for every method and kind."""
    layout = [[(0, 0, 4), (1, 0, 3), (0, 6, 3), (0, 4, 2)]]
    lengths = doc_lengths_of(layout)
    rows = rank_rows(layout, 0)
    for kind in KINDS:
        inputs = random_inputs(kind, sum(lengths), seed=9)
        ref = oracle(inputs, lengths, SCALE)
        for method, backend in [(m, "auto") for m in METHODS] + [("all_scan", "chunked")]:
            local = {n: (x[rows] if per_token(x, sum(lengths)) else x) for n, x in inputs.items()}
            out = linear_attention(
                local["q"],
                local["k"],
                local["v"],
                layout[0],
                log_decay=local["log_decay"],
                beta=local["beta"],
                scale=SCALE,
                config=LinearSPConfig(backend=backend, scan=method, num_blocks=2),
            )
            assert_close(out, ref[rows], "linear_fp64", f"{kind}, {method}, {backend}")


def test_all_scan_plan_follows_zigzag_chains():
    layout = layout_pieces([300, 10], world_size=3, tokens_per_rank=110)
    chains = chains_of(layout)
    assert len(chains) == 1  # only the long document is cut
    assert [rank for rank, _, _ in chains[0]] == [0, 1, 2, 1, 0]  # heads in rank order, tails back
    plans = [build_scan_plan(layout, r) for r in range(3)]
    assert all(p.max_chain_edges == 4 for p in plans)
    assert [len(p.out_pieces) for p in plans] == [1, 2, 1]  # rank 2 holds one merged middle piece
    assert [len(p.in_pieces) for p in plans] == [1, 2, 1]
    # every edge is seen identically by its two ends
    for p in plans:
        for slot, e in enumerate(p.out_edges):
            assert plans[e.dst_rank].in_edges[e.dst_slot] == e and e.src_slot == slot
    chunks = chunked_layout([100, 35, 5, 20], 4)
    assert [[r for r, _, _ in c] for c in chains_of(chunks)] == [[0, 1, 2], [2, 3]]


def test_all_scan_bad_input_raises():
    q = torch.zeros(10, 2, 4)
    with pytest.raises(PieceError, match="tile each document"):
        linear_attention(q, q, torch.zeros(10, 2, 3), [(0, 0, 5), (0, 6, 5)])
    with pytest.raises(ValueError, match="cover 9 tokens"):
        linear_attention(q, q, torch.zeros(10, 2, 3), [(0, 0, 9)])
    with pytest.raises(ValueError, match="log_decay must be shaped"):
        linear_attention(q, q, torch.zeros(10, 2, 3), [(0, 0, 10)], log_decay=torch.zeros(3))
    with pytest.raises(ValueError, match="CUDA"):
        linear_attention(q, q, torch.zeros(10, 2, 3), [(0, 0, 10)], config=LinearSPConfig(backend="fla"))
    with pytest.raises(ValueError, match="num_blocks"):
        LinearSPConfig(num_blocks=0)
    with pytest.raises(ValueError, match="scan must be one of"):
        LinearSPConfig(scan="ring")


def test_all_scan_minimax_wrapper_keeps_weights_and_restarts_per_document():
    """One process, no layout: the replaced lightning layers compute Transformers' own MiniMax on each
    document of a packed row (which the original module would run as one sequence)."""
    from hf_distca.linear.layers import MiniMaxLightningAttentionSP, enable_linear_attention_sp

    ref = tiny_minimax("sdpa")
    model = tiny_minimax("distca")
    assert enable_linear_attention_sp(model) == 2
    assert isinstance(model.model.layers[0].self_attn, MiniMaxLightningAttentionSP)
    assert list(model.state_dict()) == list(ref.state_dict())  # checkpoints load and save unchanged
    docs = minimax_documents([37, 5, 20], seed=1)
    ids = torch.tensor([t for d in docs for t in d])[None]
    position_ids = torch.cat([torch.arange(len(d)) for d in docs])[None]
    packed = model(input_ids=ids, position_ids=position_ids).logits
    per_doc = torch.cat([ref(input_ids=torch.tensor(d)[None]).logits for d in docs], dim=1)
    rtol, atol = TOL["logits"]
    torch.testing.assert_close(packed, per_doc, rtol=rtol, atol=atol)
    # the original module runs the packed row as one sequence: different from per-document (test can fail)
    whole = ref(input_ids=ids, position_ids=position_ids).logits
    assert (whole - per_doc).abs().max() > 1e-2
    with pytest.raises(ValueError, match="use_cache=False"):
        model(input_ids=ids, position_ids=position_ids, use_cache=True)
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=16,
            hidden_size=8,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    with pytest.raises(ValueError, match="no supported linear-attention module"):
        enable_linear_attention_sp(llama)
