"""Attention logit softcapping (Gemma 2) and attention sinks (gpt-oss) through the engine and in tiny models.

Engine: ``core_attention`` with ``softcap`` / ``sinks`` on 2 gloo processes, documents cut across ranks and
work moved between servers (serial, ping-pong nano-batches, and the call run as two interleaved nano-batches
of layer-level ping-pong), against the float64 oracle of
tests/oracle.py: outputs, dq, dk, dv per rank, and the sinks' gradient summed over ranks (each rank returns
its server's share; data parallelism sums them). Models: tiny Gemma 2 and gpt-oss built from their configs
(tests/test_attention_hf.py's ``tiny_model``) under ``attn_implementation="distca"`` against Transformers'
own eager attention run document by document: logits and every parameter's gradient (the sinks' included),
in one process (packed batch; with rematerialization-aware checkpointing, float64) and cut over 2 ranks
with a DistCA layout; generation with a KV cache token for token; the refusal inside torch.compile.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from oracle import assert_close, named_layouts, oracle_with_grads, random_qkv
from test_attention_hf import (
    DOC_SETS,
    _global_rows,
    _layout,
    _module,
    _qkv,
    _rank_inputs,
    assert_grads_close,
    assert_logits_close,
    grads_of,
    greedy,
    left_padded_prompts,
    packed_batch,
    packed_run,
    per_document_reference,
    random_docs,
    tiny_config,
    tiny_model,
)
from transformers import AutoModelForCausalLM

from hf_distca import DistCAConfig, core_attention, enable_distca, metrics, plan_core_attention
from hf_distca.attention import distca_attention_forward
from hf_distca.checkpointing import enable_remat_checkpointing
from hf_distca.engine.interleave import run_interleaved
from hf_distca.features import UnsupportedFeatureError
from hf_distca.planning import attention_flops_per_pair

D, HQ, HKV = 8, 4, 2
DTYPES = {"fp64": torch.float64, "fp32": torch.float32}
SERIAL = DistCAConfig(shard_tokens=8, tolerance=0.3, backend="reference")
PING_PONG = DistCAConfig(shard_tokens=8, tolerance=0.3, backend="reference", ping_pong=True)
# the call run twice as two interleaved nano-batches (layer-level ping-pong's nodes; gradients doubled)
LAYERS = DistCAConfig(shard_tokens=8, tolerance=0.3, backend="reference", layer_ping_pong=True)
ENGINE_CASES = [  # name, dtype, window, softcap, sinks, config
    ("softcap", "fp64", None, 1.5, False, SERIAL),
    ("softcap_window_ping_pong", "fp32", 16, 1.5, False, PING_PONG),
    ("sinks", "fp64", None, None, True, SERIAL),
    ("sinks_window_ping_pong", "fp32", 24, None, True, PING_PONG),
    ("sinks_softcap_window", "fp64", 16, 1.5, True, SERIAL),
    ("sinks_softcap_window_layers", "fp64", 16, 1.5, True, LAYERS),
]
MODEL_DOCS = [40, 25, 9]
# rank 0: the head of document 0 and document 2; rank 1: the tail of document 0 (its windows reach across
# the cut) and document 1
MODEL_PIECES = [[(0, 0, 20), (2, 0, 9)], [(0, 20, 20), (1, 0, 25)]]


def _sinks(dtype: torch.dtype) -> torch.Tensor:
    """(HQ,) sink logits around the rows' log-sum-exp, so that p_sink spans ~0.05-0.9."""
    return (torch.randn(HQ, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2 + 2).to(
        dtype
    )


def _giant(world: int):
    return next(layout for layout in named_layouts(world, seed=11) if layout.name == "giant")


# ------------------------------------------------------------------------------------ worker (ranks)
def _engine_case(rank: int, world: int, case: tuple) -> dict:
    name, dtype, window, softcap, with_sinks, config = case
    layout = _giant(world)
    q_all, k_all, v_all, w_all = random_qkv(layout.total, HQ, HKV, D, DTYPES[dtype], seed=len(name))
    rows = torch.as_tensor(layout.rows(rank))
    q, k, v = (t[rows].clone().requires_grad_(True) for t in (q_all, k_all, v_all))
    sinks = _sinks(DTYPES[dtype]).requires_grad_(True) if with_sinks else None

    def call():
        return core_attention(
            q, k, v, layout.pieces[rank], config=config, window=window, softcap=softcap, sinks=sinks
        )

    calls = 2 if config.layer_ping_pong else 1  # the same call as two interleaved nano-batches
    outs = run_interleaved([call] * calls)
    sum((out * w_all[rows]).sum() for out in outs).backward()
    assert all(torch.equal(out, outs[0]) for out in outs)
    return {
        "out": outs[0].detach(),
        "dq": q.grad / calls,
        "dk": k.grad / calls,
        "dv": v.grad / calls,
        "dsinks": None if sinks is None else sinks.grad / calls,
    }


def _model_case(rank: int, arch: str) -> dict:
    docs = random_docs(MODEL_DOCS, seed=31)
    model = tiny_model(arch)
    enable_distca(model, group=dist.group.WORLD, config=DistCAConfig(shard_tokens=8, tolerance=0.0))
    pieces = MODEL_PIECES[rank]
    ids, pos = _rank_inputs(docs, pieces)
    logits = model(
        input_ids=ids, position_ids=pos, distca_layout=_layout(MODEL_PIECES, rank), use_cache=False
    )
    logits = logits.logits  # (1, T_rank, V)
    weights = torch.randn(sum(MODEL_DOCS), 128, generator=torch.Generator().manual_seed(29))  # (T, V)
    (logits[0] * weights[_global_rows(docs, pieces)]).sum().backward()
    grads = grads_of(model)
    for g in grads.values():
        dist.all_reduce(g)  # what data parallelism does with every parameter's gradient (sinks included)
    return {"logits": logits.detach(), "grads": grads}


def _worker(rank: int, world: int, archs: list[str]) -> list[dict]:
    results = [_engine_case(rank, world, case) for case in ENGINE_CASES]
    return results + [_model_case(rank, arch) for arch in archs]


# ------------------------------------------------------------------------------------ tests
def _check_engine_case(case: tuple, per_rank: list[dict], world: int) -> None:
    name, dtype, window, softcap, with_sinks, config = case
    layout = _giant(world)
    q_all, k_all, v_all, w_all = random_qkv(layout.total, HQ, HKV, D, DTYPES[dtype], seed=len(name))
    sinks = _sinks(DTYPES[dtype]) if with_sinks else None
    ref = oracle_with_grads(
        q_all, k_all, v_all, w_all, layout.doc_lens, window=window, softcap=softcap, sinks=sinks
    )
    plain = oracle_with_grads(q_all, k_all, v_all, w_all, layout.doc_lens, window=window)
    assert (plain[0] - ref[0]).abs().max() > 0.1, (
        f"{name}: softcap/sinks change nothing: the case tests nothing"
    )
    elem = q_all.element_size()
    plan = plan_core_attention(
        layout.pieces, q_row_bytes=HQ * D * elem, kv_row_bytes=2 * HKV * D * elem, options=config.planner_options(),
        flops_per_pair=attention_flops_per_pair(HQ, D), window=window,
    )  # fmt: skip
    assert plan.moves > 0 and sum(plan.bytes_sent) > 0, f"{name}: nothing moved: the case tests nothing"
    for rank, res in enumerate(per_rank):
        rows = torch.as_tensor(layout.rows(rank))
        for key, want in zip(("out", "dq", "dk", "dv"), ref[:4]):
            assert_close(res[key], want[rows], dtype, f"{name}/world={world} rank {rank} {key}")
    if with_sinks:
        total = sum(res["dsinks"].to(torch.float64) for res in per_rank)
        assert all(res["dsinks"].abs().max() > 0 for res in per_rank), f"{name}: a server computed no share"
        assert_close(total.to(DTYPES[dtype]), ref[4], dtype, f"{name}/world={world} dsinks summed over ranks")


def _eager_reference(arch: str, docs: list[list[int]]) -> tuple[torch.Tensor, dict]:
    """Every document alone under Transformers' eager attention, the workers' linear functional of the logits."""
    model = tiny_model(arch, attn="eager")
    ref = torch.cat([model(input_ids=torch.tensor([d]), use_cache=False).logits[0] for d in docs])  # (T, V)
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(29))
    (ref * weights).sum().backward()
    return ref.detach(), grads_of(model)


def test_engine_and_models_across_two_ranks():
    archs = ["gemma2", "gpt_oss"]
    results = run_distributed(_worker, 2, archs, timeout=300.0)
    for i, case in enumerate(ENGINE_CASES):
        _check_engine_case(case, [results[r][i] for r in range(2)], 2)
    docs = random_docs(MODEL_DOCS, seed=31)
    for j, arch in enumerate(archs):
        ref, ref_grads = _eager_reference(arch, docs)
        assert arch != "gpt_oss" or any("sinks" in name for name in ref_grads)
        for rank in range(2):
            res = results[rank][len(ENGINE_CASES) + j]
            rows = _global_rows(docs, MODEL_PIECES[rank])
            assert_logits_close(res["logits"][0], ref[rows])
            assert_grads_close(res["grads"], ref_grads)


def _without_feature(arch: str, model) -> None:
    """Switch the model's softcapping (Gemma 2) or sinks (gpt-oss, sinks -> -1e4: p_sink = 0) off."""
    if arch == "gemma2":
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
    else:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.fill_(-1e4)


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
def test_packed_matches_per_document_eager(arch):
    """One process, one packed row of documents up to 300 tokens, windows of 16 on alternate layers: the
    same logits and gradients as Transformers' eager attention per document (which has the feature)."""
    docs = random_docs(DOC_SETS["mixed"], seed=11)
    model = tiny_model(arch)
    windows = [layer.self_attn.sliding_window for layer in model.model.layers]
    assert 16 in windows and None in windows, windows
    ref_logits, ref_grads = per_document_reference(model, docs, attn="eager")
    inputs = {k: v for k, v in packed_batch(docs).items() if k != "labels"}
    logits, grads = packed_run(model, docs, **inputs)
    assert_logits_close(logits, ref_logits)
    assert_grads_close(grads, ref_grads)
    _without_feature(arch, model)
    plain_logits, _ = per_document_reference(model, docs, attn="eager")
    assert (plain_logits - ref_logits).abs().max() > 0.1, (
        "the feature changes nothing: the test tests nothing"
    )


@pytest.mark.filterwarnings("ignore:.*(gradient|activation)_checkpointing.*:FutureWarning")
def test_gpt_oss_remat_checkpointing_float64():
    """Rematerialization-aware checkpointing replays the kept attention output (no second attention call)
    and the sinks' gradients still reach them: float64 (experts as a plain loop: grouped_mm has no float64),
    where distca and eager attention per document agree to rounding (fp32 differs by ~3e-6 relative)."""
    docs = random_docs([30, 5, 61], seed=13)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        tiny_config("gpt_oss"), attn_implementation="distca", experts_implementation="eager"
    ).double()
    model.train()
    ref_logits, ref_grads = per_document_reference(model, docs, attn="eager")
    enable_remat_checkpointing(model)
    assert model.is_gradient_checkpointing
    metrics.reset()
    logits, grads = packed_run(model, docs, **{k: v for k, v in packed_batch(docs).items() if k != "labels"})
    layers = len(model.model.layers)
    stats = metrics.snapshot()
    assert (stats.attn_fwd_kernels, stats.attn_replays) == (layers, layers), stats
    assert_close(logits, ref_logits, "fp64", "logits")
    assert any("sinks" in name for name in ref_grads) and grads.keys() == ref_grads.keys()
    for name, want in ref_grads.items():
        assert_close(grads[name], want, "fp64", name)


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
def test_generate_matches_eager_token_for_token(arch):
    """Decoding with a KV cache (queries the last positions of their keys, padded rows) keeps the
    softcapping / sinks: the same tokens and logits as eager attention, inside the window (6 + 8 < 16)."""
    model = tiny_model(arch, eos_token_id=None, pad_token_id=0)
    model.eval()
    ids, mask = left_padded_prompts([6, 2, 5], seed=61)
    want = greedy(model, "eager", input_ids=ids, attention_mask=mask)
    got = greedy(model, "distca", input_ids=ids, attention_mask=mask)
    assert torch.equal(got.sequences, want.sequences) and len(got.logits) == 8
    for step_got, step_want in zip(got.logits, want.logits):
        assert_logits_close(step_got, step_want)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"softcap": 2.0}, r"logit softcapping \(softcap=2.0, Gemma 2\) eagerly only"),
     ({"s_aux": torch.zeros(4)}, r"attention sinks \(gpt-oss\) eagerly only")],
)  # fmt: skip
def test_refused_inside_torch_compile(kwargs, match, monkeypatch):
    """The compiled custom ops take neither: refused (naming what works) rather than dropped."""
    q, k, v = _qkv()
    distca_attention_forward(_module(), q, k, v, None, **kwargs)  # eager: computed
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(UnsupportedFeatureError, match=match):
        distca_attention_forward(_module(), q, k, v, None, **kwargs)
