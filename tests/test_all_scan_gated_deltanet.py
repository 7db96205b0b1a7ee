"""Gated DeltaNet hybrids (Qwen3-Next, OLMo-hybrid: a short causal convolution + the gated delta rule) with
documents cut across ranks.

CPU-only, gloo, one spawn per world size (2 and 4) running every case:
- the halo exchange: ``causal_conv_pieces`` on every rank's pieces (zigzag layouts, pieces shorter than
  the K - 1 halo so one halo spans several pieces and ranks, a subgroup without rank 0) against
  ``F.conv1d`` on the uncut documents, outputs and the gradients of x, weight and bias;
- the models: a tiny Qwen3-Next (gated DeltaNet, full attention, gated DeltaNet; MoE) on 2 and 4 ranks and a
  tiny OLMo-hybrid (the same layer pattern, separate projections, beta doubled) on 2, with documents cut
  across ranks by ``DistCABatches``: full-attention layers through attn_implementation="distca", gated
  DeltaNet layers through the halo exchange and the dense-transition All-Scan; the loss and every
  parameter gradient (summed over ranks) against (1) Transformers' own unmodified model run document by
  document in one process and (2) the replaced model run document by document in one process.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from all_scan_cases import doc_lengths_of, qwen3_next_documents, rank_rows, tiny_olmo_hybrid, tiny_qwen3_next
from distributed import run_distributed
from tolerances import TOL

from hf_distca.data import layout_pieces
from hf_distca.linear import LinearSPConfig
from hf_distca.linear.ops import chains_of
from hf_distca.linear.ops.conv_halo import build_halo_plan, causal_conv_pieces

SPAWN_TIMEOUT = 240
CHANNELS, KERNEL = 5, 4
HALO_LAYOUTS = {
    2: {
        "zigzag": [list(p) for p in layout_pieces([90, 30, 12], world_size=2, tokens_per_rank=66)],
        # pieces of 1-2 rows: the halo of a piece spans several earlier pieces on both ranks
        "short": [
            [(0, 0, 5), (0, 6, 2), (0, 9, 1), (0, 11, 6), (1, 0, 3)],
            [(0, 5, 1), (0, 8, 1), (0, 10, 1), (1, 3, 2), (2, 0, 4)],
        ],
    },
    4: {
        "zigzag": [list(p) for p in layout_pieces([150, 20, 10], world_size=4, tokens_per_rank=45)],
        "short": [
            [(0, 0, 3), (0, 7, 1), (1, 0, 2)],
            [(0, 3, 1), (0, 8, 2), (1, 2, 1)],
            [(0, 4, 2), (0, 10, 1), (1, 3, 4)],
            [(0, 6, 1), (0, 11, 5), (1, 7, 1)],
        ],
    },
}
MODEL_DOCS = {2: ([130, 30, 20], 90), 4: ([130, 30, 20], 45)}  # (document lengths, tokens per rank)
MODELS = {"qwen3-next": tiny_qwen3_next, "olmo-hybrid": tiny_olmo_hybrid}  # both take qwen3_next_documents


def _halo_inputs(total: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(total, CHANNELS, generator=gen, dtype=torch.float64),
        "weight": torch.randn(CHANNELS, KERNEL, generator=gen, dtype=torch.float64),
        "bias": torch.randn(CHANNELS, generator=gen, dtype=torch.float64),
        "w": torch.randn(total, CHANNELS, generator=gen, dtype=torch.float64),  # loss = sum(out * w)
    }


def _halo_case(rank: int, layout, seed: int, group=None) -> dict:
    inputs = _halo_inputs(sum(doc_lengths_of(layout)), seed)
    rows = rank_rows(layout, rank)
    x = inputs["x"][rows].clone().requires_grad_(True)
    weight = inputs["weight"].clone().requires_grad_(True)
    bias = inputs["bias"].clone().requires_grad_(True)
    out = causal_conv_pieces(x, weight, bias, layout[rank], all_pieces=layout, group=group)
    (out * inputs["w"][rows]).sum().backward()
    return {"out": out.detach(), "dx": x.grad, "dweight": weight.grad, "dbias": bias.grad}


def _model_case(rank: int, world: int, case: dict) -> dict:
    import hf_distca
    from hf_distca.data import DistCABatches
    from hf_distca.linear.layers import enable_linear_attention_sp

    docs = qwen3_next_documents(case["doc_lengths"], case["seed"])
    batches = DistCABatches(docs, rank=rank, world_size=world, tokens_per_rank=case["tokens_per_rank"])
    batch = batches.micro_batch(docs)
    model = MODELS[case["arch"]]("distca")
    hf_distca.enable_distca(model, group=None, config=hf_distca.DistCAConfig(shard_tokens=16))
    replaced = enable_linear_attention_sp(model, group=None, config=LinearSPConfig(backend="reference"))
    if case["checkpointing"]:
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
        model.train()
    # the loss in float64 (Transformers' loss casts logits to float32): the float64 oracle stays tight
    labels = batch.pop("shift_labels")[0]
    batch.pop("labels")
    logits = model(**batch).logits[0]  # (T, vocab)
    targets = sum(len(d) - 1 for d in docs)
    loss = F.cross_entropy(logits.double(), labels, ignore_index=-100, reduction="sum") / targets
    loss.backward()
    return {
        "loss": loss.detach(),
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None},
        "replaced": replaced,
        "all_pieces": batch["distca_layout"].all_pieces,
    }


def _worker(rank: int, world: int, halo_cases: list[dict], model_cases: list[dict]) -> dict:
    import torch.distributed as dist

    halos = [_halo_case(rank, case["layout"], case["seed"]) for case in halo_cases]
    members = list(range(1, world))  # a subgroup without rank 0: peers addressed through the group
    group = dist.new_group(members)
    sub = []
    if world > 2 and rank in members:
        layout = HALO_LAYOUTS[2]["short"]
        sub = [_halo_case(members.index(rank), layout + [[]] * (len(members) - 2), 21, group=group)]
    dist.barrier()
    models = [_model_case(rank, world, case) for case in model_cases]
    return {"halos": halos, "sub": sub, "models": models}


# --------------------------------------------------------------------------------------- parent side
def _conv_oracle(layout, seed: int) -> dict:
    """F.conv1d (zero padding K - 1, cut to length) on each uncut document, with gradients."""
    lengths = doc_lengths_of(layout)
    inputs = _halo_inputs(sum(lengths), seed)
    x, weight, bias = (inputs[n].clone().requires_grad_(True) for n in ("x", "weight", "bias"))
    outs, start = [], 0
    for n in lengths:
        doc = x[start : start + n].T[None]  # (1, C, L)
        conv = F.conv1d(doc, weight[:, None, :], bias, padding=KERNEL - 1, groups=CHANNELS)[0, :, :n]
        outs.append(conv.T)  # (L, C)
        start += n
    out = torch.cat(outs)
    (out * inputs["w"]).sum().backward()
    return {"out": out.detach(), "dx": x.grad, "dweight": weight.grad, "dbias": bias.grad}


def _check_halo(label: str, layout, seed: int, results: list[dict]) -> None:
    ref = _conv_oracle(layout, seed)
    rtol, atol = TOL["fp64_reordered"]
    for rank, got in enumerate(results):
        rows = rank_rows(layout, rank)
        for name in ("out", "dx"):
            torch.testing.assert_close(
                got[name], ref[name][rows], rtol=rtol, atol=atol, msg=f"{label} {name} r{rank}"
            )
    for name in ("dweight", "dbias"):  # shared parameters: the gradient is the sum over ranks
        total = sum(r[name] for r in results)
        torch.testing.assert_close(total, ref[name], rtol=rtol, atol=atol, msg=f"{label} {name}")
    # rows really cross ranks (the exchange runs), and without them the results differ (the test can fail)
    assert build_halo_plan(layout, 0, KERNEL).any_remote, label
    assert max(_without_halo_effect(layout, seed, r) for r in range(len(layout))) > 1e-2, label


def _without_halo_effect(layout, seed: int, rank: int) -> float:
    """Max |difference| between the oracle's rows of ``rank`` and its pieces convolved each on its own."""
    inputs = _halo_inputs(sum(doc_lengths_of(layout)), seed)
    rows = rank_rows(layout, rank)
    alone_pieces = [(i, 0, n) for i, (_, _, n) in enumerate(layout[rank])]
    alone = causal_conv_pieces(inputs["x"][rows], inputs["weight"], inputs["bias"], alone_pieces)
    return float((alone - _conv_oracle(layout, seed)["out"][rows]).abs().max()) if len(rows) else 0.0


def _reference_model_run(arch: str, docs: list[list[int]], replaced: bool) -> tuple[torch.Tensor, dict]:
    """Loss (mean over every next-token target) and parameter gradients of a one-process run, each
    document its own sequence: Transformers' own model, or the replaced one."""
    from hf_distca.linear.layers import enable_linear_attention_sp

    model = MODELS[arch]("sdpa")
    if replaced:
        enable_linear_attention_sp(model, config=LinearSPConfig(backend="reference"))
    targets = sum(len(d) - 1 for d in docs)
    loss = 0
    for doc in docs:
        ids = torch.tensor(doc)[None]
        logits = model(input_ids=ids).logits[0, :-1].double()
        loss = loss + F.cross_entropy(logits, ids[0, 1:], reduction="sum")
    loss = loss / targets
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _check_model(world: int, case: dict, results: list[dict]) -> None:
    assert all(r["replaced"] == 2 for r in results)
    assert chains_of(results[0]["all_pieces"]), "the model layout must cut a document across ranks"
    assert build_halo_plan(results[0]["all_pieces"], 0, 4).any_remote, "conv rows must cross ranks"
    docs = qwen3_next_documents(case["doc_lengths"], case["seed"])
    total_loss = float(sum(r["loss"] for r in results))
    label = f"{case['arch']}, {world} ranks, checkpointing={case['checkpointing']}"
    # (1) Transformers' own modules (their delta rule in float32), (2) the replaced modules (float64 but
    # for the gated RMS norms, which compute in float32)
    for oracle, loss_tol, grad_tol in (
        ("transformers", "train_loss", "grads"),
        ("replaced", "fp32_norms_loss", "fp32_norms_grads"),
    ):
        loss, grads = _reference_model_run(case["arch"], docs, replaced=oracle == "replaced")
        rtol = TOL[loss_tol][0]
        assert abs(total_loss - float(loss)) <= rtol * abs(float(loss)), (
            label,
            oracle,
            total_loss,
            float(loss),
        )
        for name, want in grads.items():
            got = sum(r["grads"][name] for r in results)
            rtol, floor = TOL[grad_tol]
            torch.testing.assert_close(
                got, want, rtol=rtol, atol=floor * float(want.abs().max()), msg=f"{label} vs {oracle}: {name}"
            )


@pytest.mark.parametrize("world", [2, 4])
def test_all_scan_gated_deltanet_exact_across_ranks(world):
    halo_cases = [
        dict(name=name, layout=layout, seed=30 + i)
        for i, (name, layout) in enumerate(HALO_LAYOUTS[world].items())
    ]
    model_cases = [
        dict(
            arch=arch,
            doc_lengths=MODEL_DOCS[world][0],
            tokens_per_rank=MODEL_DOCS[world][1],
            seed=5,
            checkpointing=world == 4,
        )
        for arch in (["qwen3-next", "olmo-hybrid"] if world == 2 else ["qwen3-next"])
    ]
    results = run_distributed(_worker, world, halo_cases, model_cases, timeout=SPAWN_TIMEOUT)
    for index, case in enumerate(halo_cases):
        _check_halo(
            f"{world} ranks, {case['name']}",
            case["layout"],
            case["seed"],
            [r["halos"][index] for r in results],
        )
    if world > 2:
        sub_layout = HALO_LAYOUTS[2]["short"] + [[]] * (world - 3)
        _check_halo(f"subgroup of {world - 1}", sub_layout, 21, [r["sub"][0] for r in results[1:]])
    for index, case in enumerate(model_cases):
        _check_model(world, case, [r["models"][index] for r in results])


# ------------------------------------------------------------------------------ single process (no spawn)
def test_all_scan_conv_halo_single_process_pieces_out_of_order():
    """One process, a document in non-adjacent pieces (some shorter than the halo): the halo rows are read
    in place; equal to F.conv1d on the uncut documents."""
    layout = [[(0, 0, 4), (1, 0, 3), (0, 6, 1), (0, 4, 2), (0, 7, 6), (1, 3, 2)]]
    got = _halo_case(0, layout, seed=8)
    ref = _conv_oracle(layout, 8)
    rows = rank_rows(layout, 0)
    rtol, atol = TOL["fp64_reordered"]
    for name in ("out", "dx"):
        torch.testing.assert_close(got[name], ref[name][rows], rtol=rtol, atol=atol)
    for name in ("dweight", "dbias"):
        torch.testing.assert_close(got[name], ref[name], rtol=rtol, atol=atol)
    assert not build_halo_plan(layout, 0, KERNEL).any_remote
    assert _without_halo_effect(layout, 8, 0) > 1e-2  # the halo rows matter (the test can fail)


def test_all_scan_qwen3_next_wrapper_restarts_per_document():
    """One process, no layout: the replaced gated DeltaNet layers compute Transformers' own Qwen3-Next on
    each document of a packed row (cu_seq_lens, or position ids only), and on a padded batch."""
    from hf_distca.linear.layers import Qwen3NextGatedDeltaNetSP, enable_linear_attention_sp

    ref = tiny_qwen3_next("sdpa")
    model = tiny_qwen3_next("sdpa")
    assert enable_linear_attention_sp(model) == 2
    assert isinstance(model.model.layers[0].linear_attn, Qwen3NextGatedDeltaNetSP)
    assert list(model.state_dict()) == list(ref.state_dict())  # checkpoints load and save unchanged
    docs = qwen3_next_documents([37, 2, 20], seed=1)  # a 2-token document: shorter than the conv halo
    ids = torch.tensor([t for d in docs for t in d])[None]
    per_doc = torch.cat([ref(input_ids=torch.tensor(d)[None]).logits for d in docs], dim=1)
    rtol, atol = TOL["logits"]
    # softmax layers (sdpa) need a mask that keeps documents apart: compare the linear layers alone too
    cu = torch.tensor([0, 37, 39, 59], dtype=torch.int32)
    position_ids = torch.cat([torch.arange(len(d)) for d in docs])[None]
    hidden = torch.randn(1, ids.shape[1], 32, dtype=torch.float64)
    theirs = torch.cat(
        [ref.model.layers[2].linear_attn(hidden[:, a:b]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())],
        dim=1,
    )
    ours_cu = model.model.layers[2].linear_attn(hidden, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    torch.testing.assert_close(ours_cu, theirs, rtol=rtol, atol=atol)
    # the original module runs the packed row as one sequence: different (the test can fail)
    assert (ref.model.layers[2].linear_attn(hidden) - theirs).abs().max() > 1e-2
    # the whole model with the distca attention and position ids only (the pre-hook passes them on)
    import hf_distca

    packed_model = tiny_qwen3_next("distca")
    enable_linear_attention_sp(packed_model)
    hf_distca.enable_distca(packed_model, group=None, config=hf_distca.DistCAConfig(shard_tokens=16))
    packed = packed_model(input_ids=ids, position_ids=position_ids).logits
    torch.testing.assert_close(packed, per_doc, rtol=rtol, atol=atol)
    # a left-padded batch: Transformers' own module handles padding; the replacement must agree
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :6] = 0
    rows = torch.stack([torch.tensor(docs[2]), torch.tensor([0] * 6 + docs[0][:14])])
    torch.testing.assert_close(
        model(input_ids=rows, attention_mask=mask).logits[mask.bool()],
        ref(input_ids=rows, attention_mask=mask).logits[mask.bool()],
        rtol=rtol,
        atol=atol,
    )
    with pytest.raises(ValueError, match="use_cache=False"):
        model(input_ids=ids, use_cache=True)
    if importlib.util.find_spec("fla") is None:
        # what Transformers itself does with a packed row: without flash-linear-attention it refuses
        # cu_seq_lens (with it, its recurrence restarts per document but its convolution does not)
        with pytest.raises(ValueError, match="packed sequences"):
            ref.model.layers[2].linear_attn(hidden, cu_seq_lens_q=cu, cu_seq_lens_k=cu)


def test_all_scan_conv_halo_bad_input_raises():
    from hf_distca.planning import PieceError

    x, weight = torch.zeros(10, 3), torch.zeros(3, 4)
    with pytest.raises(ValueError, match="x \\(T, C\\) and weight \\(C, K\\)"):
        causal_conv_pieces(x, torch.zeros(4, 4), None, [(0, 0, 10)])
    with pytest.raises(ValueError, match="cover 9 tokens"):
        causal_conv_pieces(x, weight, None, [(0, 0, 9)])
    with pytest.raises(PieceError, match="tile each document"):
        causal_conv_pieces(x, weight, None, [(0, 0, 5), (0, 6, 5)])
    with pytest.raises(ValueError, match="all_pieces lists 2 ranks"):
        causal_conv_pieces(x, weight, None, [(0, 0, 10)], all_pieces=[[(0, 0, 10)], [(1, 0, 3)]])
    with pytest.raises(ValueError, match="pieces differ from all_pieces"):
        causal_conv_pieces(x, weight, None, [(0, 0, 10)], all_pieces=[[(1, 0, 10)]])
    with pytest.raises(ValueError, match="at least one tap"):
        build_halo_plan([[(0, 0, 3)]], 0, 0)


def test_all_scan_olmo_hybrid_wrapper_restarts_per_document():
    """One process, no layout: the replaced OLMo-hybrid gated DeltaNet layers compute Transformers' own
    model on each document of a packed row (position ids only, through the decoder-layer pre-hook; and
    cu_seq_lens for a layer alone); beta is doubled as the config asks."""
    import hf_distca
    from hf_distca.linear.layers import OlmoHybridGatedDeltaNetSP, enable_linear_attention_sp

    ref = tiny_olmo_hybrid("sdpa")
    model = tiny_olmo_hybrid("distca")
    assert enable_linear_attention_sp(model) == 2
    layer = model.model.layers[2].linear_attn
    assert isinstance(layer, OlmoHybridGatedDeltaNetSP) and layer.allow_neg_eigval
    assert list(model.state_dict()) == list(ref.state_dict())  # checkpoints load and save unchanged
    hf_distca.enable_distca(model, group=None, config=hf_distca.DistCAConfig(shard_tokens=16))
    docs = qwen3_next_documents([37, 2, 20], seed=1)  # a 2-token document: shorter than the conv halo
    ids = torch.tensor([t for d in docs for t in d])[None]
    position_ids = torch.cat([torch.arange(len(d)) for d in docs])[None]
    per_doc = torch.cat([ref(input_ids=torch.tensor(d)[None]).logits for d in docs], dim=1)
    rtol, atol = TOL["logits"]
    torch.testing.assert_close(
        model(input_ids=ids, position_ids=position_ids).logits, per_doc, rtol=rtol, atol=atol
    )
    assert (
        ref(input_ids=ids).logits - per_doc
    ).abs().max() > 1e-2  # one sequence: differs (the test can fail)
    cu = torch.tensor([0, 37, 39, 59], dtype=torch.int32)
    hidden = torch.randn(1, ids.shape[1], 32, dtype=torch.float64)
    theirs = torch.cat(
        [ref.model.layers[2].linear_attn(hidden[:, a:b]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())],
        dim=1,
    )
    torch.testing.assert_close(
        layer(hidden, cu_seq_lens_q=cu, cu_seq_lens_k=cu), theirs, rtol=rtol, atol=atol
    )
    # without the doubled beta the layer differs: the flag is honoured
    layer.allow_neg_eigval = False
    assert (layer(hidden, cu_seq_lens_q=cu, cu_seq_lens_k=cu) - theirs).abs().max() > 1e-3
    with pytest.raises(ValueError, match="use_cache=False"):
        model(input_ids=ids, use_cache=True)
