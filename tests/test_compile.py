"""torch.compile of a ``distca`` model for training: losses and gradients equal the eager model's.

Inside a compiled region the attention function hands every call to the engine's custom ops
(hf_distca.engine.compiled), so the whole model compiles with ``fullgraph=True``: one process's packed
documents (position ids or cu_seq_lens), and DistCA layouts on 2 gloo processes with documents cut across
them (ping-pong on and off, rematerialization-aware checkpointing, whose recompute must not run core attention
again). A new layout of the same shapes does not recompile. Most cases compile with the ``aot_eager``
backend (Dynamo and AOTAutograd, no code generation: seconds on the CPU); one compiles with Inductor.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import pytest
import torch
from distributed import run_distributed
from oracle import Layout, pack_sequential
from tolerances import TOL
from transformers import LlamaConfig, LlamaForCausalLM

import hf_distca
from hf_distca import metrics
from hf_distca.data.loader import DistCALayout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [60, 150, 40]
VOCAB = 128


def tiny_llama(layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)  # fmt: skip
    return LlamaForCausalLM._from_config(cfg, attn_implementation="distca", dtype=torch.float32)


def global_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, position ids (restarting per document) and logit weights of the concatenated documents."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (sum(DOCS),), generator=g)
    positions = torch.cat([torch.arange(n) for n in DOCS])
    weights = torch.randn(sum(DOCS), VOCAB, generator=g)
    return ids, positions, weights


def step(model, weights: torch.Tensor, **inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """loss = sum(logits * weights) and the parameter gradients (names without torch.compile's prefix)."""
    model.zero_grad()
    loss = (model(**inputs).logits[0] * weights).sum()
    loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads


def assert_same_step(got, want, msg: str) -> None:
    (loss, grads), (ref_loss, ref_grads) = got, want
    torch.testing.assert_close(loss, ref_loss, rtol=TOL["logits"][0], atol=0, msg=msg)
    for name, ref in ref_grads.items():
        rtol, floor = TOL["grads"]
        torch.testing.assert_close(
            grads[name], ref, rtol=rtol, atol=floor * ref.abs().max().item(), msg=f"{msg} {name}"
        )


@pytest.mark.parametrize("boundaries", ["position_ids", "cu_seq_lens"])
def test_compiled_packed_documents_match_eager(boundaries):
    ids, positions, weights = global_batch()
    inputs = {"input_ids": ids[None], "position_ids": positions[None]}
    if boundaries == "cu_seq_lens":
        cu = torch.tensor([0, *DOCS]).cumsum(0, dtype=torch.int32)
        inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(DOCS), max_length_k=max(DOCS))
    model = tiny_llama()
    eager = step(copy.deepcopy(model), weights, **inputs)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert_same_step(step(compiled, weights, **inputs), eager, boundaries)
    # the boundaries are data, not constants of the graph: other documents, same graph
    other = torch.cat([torch.arange(n) for n in (200, 50)])[None]
    with torch.compiler.set_stance("fail_on_recompile"):
        moved = step(compiled, weights, input_ids=ids[None], position_ids=other)
    assert not torch.equal(moved[0], compiled_loss := step(compiled, weights, **inputs)[0])
    torch.testing.assert_close(compiled_loss, eager[0], rtol=TOL["logits"][0], atol=0)


def test_compiled_sliding_window_layers_match_eager():
    """Mistral with a window shorter than the documents, local and with a one-process DistCA layout: each
    layer's window reaches the custom ops (and their plan cache, keyed by window)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=24, use_cache=False)  # fmt: skip
    model = MistralForCausalLM._from_config(cfg, attn_implementation="distca", dtype=torch.float32)
    ids, positions, weights = global_batch()
    pieces = tuple((d, 0, n) for d, n in enumerate(DOCS))
    eager_model = copy.deepcopy(model)
    for m in (model, eager_model):
        hf_distca.enable_distca(m, config=hf_distca.DistCAConfig(backend="reference"))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for layout in (None, DistCALayout(pieces=pieces, all_pieces=(pieces,))):
        inputs = {"input_ids": ids[None], "position_ids": positions[None]}
        if layout is not None:
            inputs["distca_layout"] = layout
        eager = step(eager_model, weights, **inputs)
        assert_same_step(step(compiled, weights, **inputs), eager, f"window, layout={layout is not None}")
    cfg_full = copy.deepcopy(cfg)
    cfg_full.sliding_window = None
    full = MistralForCausalLM._from_config(cfg_full, attn_implementation="distca", dtype=torch.float32)
    full.load_state_dict(eager_model.state_dict())
    assert not torch.allclose(
        step(full, weights, input_ids=ids[None], position_ids=positions[None])[0], eager[0]
    )


def test_inductor_compiles_packed_documents():
    ids, positions, weights = global_batch()
    inputs = {"input_ids": ids[None], "position_ids": positions[None]}
    model = tiny_llama(layers=1)
    eager = step(copy.deepcopy(model), weights, **inputs)
    assert_same_step(step(torch.compile(model, fullgraph=True), weights, **inputs), eager, "inductor")


@pytest.mark.parametrize("region", ["model", "each layer"])
def test_remat_checkpointing_under_compile_never_recomputes_attention(region):
    """Whole model compiled: the checkpoint is traced (selective checkpointing keeps the attention ops'
    outputs); each decoder layer compiled: the eager checkpoint around it hands them to the ops."""
    ids, positions, weights = global_batch()
    inputs = {"input_ids": ids[None], "position_ids": positions[None]}
    model = tiny_llama()
    model.train()
    eager_model = copy.deepcopy(model)
    for m in (model, eager_model):
        hf_distca.enable_remat_checkpointing(m)
    eager = step(eager_model, weights, **inputs)
    if region == "model":
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    else:
        compiled = model
        for layer in model.model.layers:
            layer.compile(fullgraph=True, backend="aot_eager")
    step(compiled, weights, **inputs)  # compiles
    metrics.reset()
    got = step(compiled, weights, **inputs)
    assert metrics.snapshot().attn_fwd_kernels == 2  # one per layer: the recompute kept the outputs
    assert_same_step(got, eager, "remat")


def test_padded_batches_are_refused_inside_fullgraph_and_run_eagerly_otherwise():
    model = tiny_llama(layers=1)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    ids = torch.randint(0, VOCAB, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0
    # fullgraph: Dynamo reports our refusal inside its own error (without fullgraph the call falls back to eager)
    with pytest.raises(Exception, match="padded batches need an eager model"):
        compiled(input_ids=ids, attention_mask=mask)
    eager = torch.compile(model, backend="aot_eager")(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(eager, model(input_ids=ids, attention_mask=mask).logits, rtol=0, atol=0)


@pytest.mark.parametrize("checkpointing", [[], ["--gradient-checkpointing"]], ids=["plain", "remat"])
def test_recipe_trains_compiled_with_the_losses_of_eager(tmp_path, checkpointing):
    """The Trainer's own torch.compile (TrainingArguments(torch_compile=True)) through the recipe's
    --torch-compile: the same per-step losses as the eager run."""
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    import finetune_long_docs

    common = ["--max-steps", "3", "--tokens-per-rank", "1024", "--optim", "sgd", "--no-save", "--cpu",
              "--num-documents", "40", *checkpointing]  # fmt: skip
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["--torch-compile", "aot_eager"])):
        out = tmp_path / name
        summary = finetune_long_docs.main([*common, *extra, "--output-dir", str(out)])
        assert summary["wrapped"] == ("OptimizedModule" if extra else "LlamaForCausalLM")
        runs[name] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(runs["eager"]) == 3
    for got, want in zip(runs["compiled"], runs["eager"], strict=True):
        assert abs(got["loss"] - want["loss"]) <= TOL["train_loss"][0] * abs(want["loss"]), (got, want)
        assert got["attn_fwd_kernels"] == want["attn_fwd_kernels"]  # remat: no recompute of attention either


# ------------------------------------------------------------------------- DistCA layouts, 2 processes
def _layouts(world: int) -> list[Layout]:
    """Two layouts of the same per-rank token counts: the documents in order, and in reverse order."""
    first = Layout("in order", [0, 1, 2], DOCS, pack_sequential(DOCS, world))
    order = [2, 1, 0]
    lens = [DOCS[d] for d in order]
    reverse = [[(order[d], s, n) for d, s, n in rank] for rank in pack_sequential(lens, world)]
    return [first, Layout("reversed", order, lens, reverse)]


def _rank_inputs(layout: Layout, rank: int) -> tuple[dict, torch.Tensor]:
    ids, _, weights = global_batch()
    starts = {d: sum(DOCS[:d]) for d in range(len(DOCS))}
    rows = torch.tensor([starts[d] + p for d, s, n in layout.pieces[rank] for p in range(s, s + n)])
    positions = torch.tensor([p for _, s, n in layout.pieces[rank] for p in range(s, s + n)])
    pieces = tuple(tuple(p) for p in layout.pieces[rank])
    all_pieces = tuple(tuple(tuple(p) for p in r) for r in layout.pieces)
    inputs = {
        "input_ids": ids[rows][None],
        "position_ids": positions[None],
        "distca_layout": DistCALayout(pieces=pieces, all_pieces=all_pieces),
    }
    return inputs, weights[rows]


def _compiled_layout_cases(rank: int, world: int) -> list[dict]:
    results = []
    for ping_pong in (False, True):
        for remat in (False, True):
            config = hf_distca.DistCAConfig(
                shard_tokens=16, tolerance=0.05, backend="reference", ping_pong=ping_pong
            )
            model = tiny_llama()
            if remat:
                model.train()
                hf_distca.enable_remat_checkpointing(model)
            eager_model = copy.deepcopy(model)
            for m in (model, eager_model):
                hf_distca.enable_distca(m, config=config)
            compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
            for i, layout in enumerate(_layouts(world)):
                inputs, weights = _rank_inputs(layout, rank)
                eager = step(eager_model, weights, **inputs)
                metrics.reset()
                if i == 0:
                    got = step(compiled, weights, **inputs)
                else:  # a new layout of the same shapes runs the same graph
                    with torch.compiler.set_stance("fail_on_recompile"):
                        got = step(compiled, weights, **inputs)
                stats = metrics.snapshot()
                results.append({"case": (ping_pong, remat, layout.name), "got": got, "eager": eager,
                                "calls": stats.calls, "kernels": stats.attn_fwd_kernels,
                                "bytes": stats.bytes_sent})  # fmt: skip
    return results


@pytest.mark.slow
def test_compiled_distca_layouts_match_eager_on_two_ranks():
    ranks = run_distributed(_compiled_layout_cases, 2, timeout=280)
    for rank, results in enumerate(ranks):
        for res in results:
            ping_pong, remat, name = res["case"]
            msg = f"rank {rank}, ping_pong={ping_pong}, remat={remat}, {name}"
            assert_same_step(res["got"], res["eager"], msg)
            assert res["calls"] == 2, msg  # one engine call per layer, none again in the recompute
            assert res["bytes"] > 0, msg  # documents cut across the ranks: the engine really exchanged rows


def test_remat_traced_inside_compile_is_refused_on_torch_older_than_it_needs(monkeypatch):
    """torch < 2.13's Inductor cannot compile the backward of a rematerialization-aware checkpoint traced in a
    compiled region: refused with a message naming the versions, whatever the backend and fullgraph."""
    torch.compiler.reset()  # the same layers compiled by an earlier test would run from Dynamo's cache, untraced
    ids, positions, weights = global_batch()
    inputs = {"input_ids": ids[None], "position_ids": positions[None]}
    model = tiny_llama(layers=1)
    model.train()
    hf_distca.enable_remat_checkpointing(model)
    monkeypatch.setattr(torch, "__version__", "2.12.1")
    for fullgraph in (True, False):
        with pytest.raises(Exception, match=r"needs torch >= 2\.13, this is torch 2\.12\.1"):
            step(torch.compile(model, fullgraph=fullgraph, backend="aot_eager"), weights, **inputs)
