"""Rematerialization-aware checkpointing: exact, and no core-attention forward in backward.

A tiny Llama (fp32) is trained for one step three ways on the same data: without checkpointing
("none"), with Transformers' plain activation checkpointing ("recompute") and with
rematerialization-aware checkpointing ("remat", hf_distca.enable_remat_checkpointing). The loss and
every parameter gradient of "recompute" and "remat" must equal "none" within fp32 tolerance; "remat"
must run exactly as many core-attention forward kernels as "none" (its recompute replays the kept
outputs) and send no more bytes than "recompute" (in fact exactly as many as "none"). Covered on one
process (the local path: packed documents, no DistCA layout; and the engine with a layout) and on 2 and 4
gloo processes (the distributed engine, documents cut over ranks): :func:`remat_case` and
:func:`check_remat_case` run inside the spawns of test_engine_distributed.py
(``test_engine_distributed_and_remat``; spawning processes costs more than the case itself).
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
import torch.distributed as dist
from engine_bytes import nonzero, phase_counts
from tolerances import TOL
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, LlamaConfig

import hf_distca
from hf_distca import DistCAConfig, enable_distca, metrics, plan_core_attention
from hf_distca.checkpointing import remat_checkpointing_kwargs
from hf_distca.engine.remat import remat_context_fn
from hf_distca.planning import traffic

MODES = ("none", "recompute", "remat")
LAYERS = 2
VOCAB = 128


def tiny_llama(seed: int = 0):
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=1024,
        initializer_range=0.2,
        attention_dropout=0.0,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="distca").float()


def with_mode(model, mode: str):
    model = copy.deepcopy(model)
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing_enable's new name (5.24)
        if mode == "recompute":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif mode == "remat":
            hf_distca.enable_remat_checkpointing(model)
    return model


def docs_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(got: dict, want: dict, label: str) -> None:
    assert got.keys() == want.keys() and len(got) > 0, label
    rtol, scale = TOL["grads"]
    for name in want:
        atol = scale * float(want[name].abs().max())
        torch.testing.assert_close(
            got[name], want[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{label} {n}: {m}"
        )


def check_modes(runs: dict[str, dict], label: str, *, bytes_moved: bool) -> None:
    """runs[mode]: loss, grads, stats (metrics of the step). The claims of the module docstring."""
    none, recompute, remat = (runs[m] for m in MODES)
    for mode in ("recompute", "remat"):
        rtol = TOL["train_loss"][0]
        assert abs(runs[mode]["loss"] - none["loss"]) <= rtol * abs(none["loss"]), (label, mode)
        assert_grads_close(runs[mode]["grads"], none["grads"], f"{label} {mode}")
    kernels = {m: runs[m]["stats"].attn_fwd_kernels for m in MODES}
    assert kernels["none"] > 0 and kernels["remat"] == kernels["none"], (label, kernels)
    assert kernels["recompute"] == 2 * kernels["none"], (label, kernels)  # the recompute ran them again
    assert remat["stats"].attn_replays == LAYERS and none["stats"].attn_replays == 0, label
    sent = {m: runs[m]["stats"].bytes_sent for m in MODES}
    assert sent["remat"] == sent["none"] <= sent["recompute"], (label, sent)
    assert (sent["remat"] < sent["recompute"]) == bytes_moved, (label, sent)


# ------------------------------------------------------------------------------- one process, local
def local_batch() -> dict:
    """Five seeded documents (lengths 37, 1, 60, 12, 5) packed into one row as the plain Transformers path
    gets them (DataCollatorWithFlattening: no DistCA layout)."""
    docs = docs_of([37, 1, 60, 12, 5], seed=3)
    return DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": d} for d in docs])


def _step(model, **inputs) -> tuple[float, dict]:
    metrics.reset()
    out = model(**inputs, use_cache=False)
    out.loss.backward()
    return float(out.loss.detach()), grads_of(model)


def test_remat_local_path_single_process():
    """--attn local / plain Transformers use: packed documents, no DistCA layout, no process group."""
    base = tiny_llama()
    batch = local_batch()
    runs = {}
    for mode in MODES:
        loss, grads = _step(with_mode(base, mode), **batch)
        runs[mode] = {"loss": loss, "grads": grads, "stats": metrics.snapshot()}
    check_modes(runs, "local", bytes_moved=False)


def test_remat_engine_single_process():
    """The engine with a DistCA layout on one process (a document cut into two local pieces)."""
    base = tiny_llama(seed=1)
    docs = docs_of([30, 9, 41], seed=5)
    pieces = [(0, 0, 12), (2, 0, 41), (1, 0, 9), (0, 12, 18)]
    ids, pos = rank_inputs(docs, pieces)
    weights = torch.randn(len(pos[0]), VOCAB, generator=torch.Generator().manual_seed(2))
    runs = {}
    for mode in MODES:
        model = with_mode(base, mode)
        enable_distca(model, config=DistCAConfig(shard_tokens=8, backend="reference"))
        metrics.reset()
        layout = Layout([pieces])
        logits = model(input_ids=ids, position_ids=pos, distca_layout=layout.of(0), use_cache=False).logits
        loss = (logits[0] * weights).sum()
        loss.backward()
        runs[mode] = {"loss": float(loss.detach()), "grads": grads_of(model), "stats": metrics.snapshot()}
    check_modes(runs, "engine/1", bytes_moved=False)


def test_remat_kwargs_compose_and_refuse_reentrant():
    kwargs = remat_checkpointing_kwargs({"preserve_rng_state": False})
    assert kwargs == {"preserve_rng_state": False, "use_reentrant": False, "context_fn": remat_context_fn}
    entered = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            entered.append(self.name)

        def __exit__(self, *exc):
            entered.append("/" + self.name)

    composed = remat_checkpointing_kwargs({"context_fn": lambda: (Recorder("f"), Recorder("r"))})[
        "context_fn"
    ]
    forward, recompute = composed()
    with forward:
        pass
    assert entered == ["f", "/f"]
    with pytest.raises(ValueError, match="non-reentrant"):
        remat_checkpointing_kwargs({"use_reentrant": True})


# ---------------------------------------------------------------------------- 2 and 4 processes
class Layout:
    """Every rank's pieces; ``of(rank)`` is a fresh layout object per forward, as the data path makes."""

    def __init__(self, pieces_per_rank):
        self.pieces_per_rank = pieces_per_rank

    def of(self, rank: int):
        from hf_distca.data.loader import DistCALayout

        all_pieces = tuple(tuple(tuple(p) for p in r) for r in self.pieces_per_rank)
        return DistCALayout(pieces=all_pieces[rank], all_pieces=all_pieces)


def rank_inputs(docs, pieces) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [t for doc, start, n in pieces for t in docs[doc][start : start + n]]
    pos = [p for _, start, n in pieces for p in range(start, start + n)]
    return torch.tensor([ids]), torch.tensor([pos])


def global_rows(docs, pieces) -> torch.Tensor:
    offsets = [0]
    for d in docs:
        offsets.append(offsets[-1] + len(d))
    return torch.tensor([offsets[doc] + start + i for doc, start, n in pieces for i in range(n)])


LENGTHS = [150, 40, 25, 9, 31, 60]
PIECES = {
    # document 0 is cut over both ranks and rank 0 holds most of the attention work: DistCA moves some
    2: [[(0, 0, 100), (3, 0, 9), (4, 0, 31)], [(0, 100, 50), (1, 0, 40), (2, 0, 25), (5, 0, 60)]],
    4: [
        [(0, 0, 80), (3, 0, 9)],
        [(0, 80, 40), (1, 0, 40)],
        [(0, 120, 30), (2, 0, 25), (4, 0, 31)],
        [(5, 0, 60)],
    ],
}


def rank_step_inputs(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, Layout, torch.Tensor]:
    """This rank's (input_ids, position_ids, every rank's Layout, loss weights) of the documents LENGTHS
    laid out as PIECES[world]; the weights are this rank's rows of one seeded (tokens, VOCAB) draw."""
    docs = docs_of(LENGTHS, seed=11)
    pieces = PIECES[world][rank]
    ids, pos = rank_inputs(docs, pieces)
    weights = torch.randn(sum(LENGTHS), VOCAB, generator=torch.Generator().manual_seed(13))[
        global_rows(docs, pieces)
    ]
    return ids, pos, Layout(PIECES[world]), weights


def run_model_steps(rank: int, world: int, runs: dict[str, tuple[str, DistCAConfig]]) -> dict:
    """For every ``name: (checkpointing mode, config)`` of ``runs``, one training step on this rank of the
    tiny Llama on :func:`rank_step_inputs` (:func:`train_once`)."""
    base = tiny_llama(seed=7)
    ids, pos, layout, weights = rank_step_inputs(rank, world)
    results = {}
    for name, (mode, config) in runs.items():
        model = with_mode(base, mode)
        enable_distca(model, group=dist.group.WORLD, config=config)
        results[name] = train_once(model, ids, pos, layout.of(rank), weights)
    return results


def remat_case(rank: int, world: int) -> dict:
    """One training step of each mode on this rank; loss and gradients summed over the ranks."""
    config = DistCAConfig(shard_tokens=8, tolerance=0.0)
    return run_model_steps(rank, world, {mode: (mode, config) for mode in MODES})


def train_once(model, ids, pos, distca_layout, weights) -> dict:
    """One forward and backward of ``model`` on this rank's tokens: the loss and every parameter gradient
    summed over the ranks, and this rank's engine metrics."""
    metrics.reset()
    logits = model(input_ids=ids, position_ids=pos, distca_layout=distca_layout, use_cache=False).logits
    loss = (logits[0] * weights).sum()
    loss.backward()
    return summed_over_ranks(model, loss)


def summed_over_ranks(model, loss: torch.Tensor) -> dict:
    """After a backward of ``loss``: the loss and every parameter gradient summed over the ranks, and this
    rank's engine metrics."""
    stats = metrics.snapshot()
    total = torch.tensor([float(loss.detach())], dtype=torch.float64)
    dist.all_reduce(total)
    grads = grads_of(model)
    for g in grads.values():
        dist.all_reduce(g)
    return {"loss": float(total), "grads": grads, "stats": stats}


def check_remat_case(per_rank: list[dict], world: int) -> None:
    moved = False
    for rank, runs in enumerate(per_rank):
        check_modes(runs, f"engine/{world} rank {rank}", bytes_moved=runs["none"]["stats"].bytes_sent > 0)
        moved |= runs["none"]["stats"].bytes_sent > 0
    assert moved  # documents cut over ranks: the engine really communicated
    for runs in per_rank[1:]:  # every rank got the same summed loss
        assert runs["remat"]["loss"] == per_rank[0]["remat"]["loss"]
    # phase by phase, every mode's bytes are the traffic ledger's for the plan of every layer: the forward
    # phases once per layer (twice with plain recompute), the backward phases once
    plan = plan_core_attention(
        PIECES[world], q_row_bytes=4 * 16 * 4, kv_row_bytes=2 * 2 * 16 * 4,
        options=DistCAConfig(shard_tokens=8, tolerance=0.0).planner_options(),
    )  # fmt: skip  # tiny_llama in fp32: 4 query and 2 KV heads of 16
    ledger = traffic.plan_bytes(plan)
    forwards = {"none": LAYERS, "recompute": 2 * LAYERS, "remat": LAYERS}
    for rank, runs in enumerate(per_rank):
        for mode in MODES:
            want = phase_counts(ledger, rank, forwards[mode], LAYERS)
            assert nonzero(runs[mode]["stats"].phase_bytes) == want, (world, rank, mode)


# ------------------------------------------------------------------------------- the Trainer path
def test_remat_trainer_path_is_the_default(tmp_path):
    """recipes/finetune_long_docs.py (Trainer + DistCACallback), one process: --gradient-checkpointing is
    rematerialization-aware by default and --recompute-attention restores plain recompute; the losses of
    every step equal the run without checkpointing, for the engine (--attn distca) and the local path."""
    from test_recipe import load_recipe

    sample = tmp_path / "lengths.json"
    sample.write_text("[40, 700, 1500, 90, 300]")
    recipe = load_recipe()
    flags = {
        "none": [],
        "remat": ["--gradient-checkpointing"],
        "recompute": ["--gradient-checkpointing", "--recompute-attention"],
    }
    for attn in ("distca", "local"):
        records = {}
        for mode, extra in flags.items():
            out = tmp_path / f"{attn}-{mode}"
            recipe.main(
                ["--doc-lengths", str(sample), "--num-documents", "20", "--max-steps", "2", "--grad-accum", "2",
                 "--tokens-per-rank", "1024", "--optim", "sgd", "--attn", attn, "--output-dir", str(out), "--no-save",
                 *extra]
            )  # fmt: skip
            records[mode] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        for mode in ("remat", "recompute"):
            for got, want in zip(records[mode], records["none"], strict=True):
                assert abs(got["loss"] - want["loss"]) <= TOL["train_loss"][0] * abs(want["loss"]), (
                    attn,
                    mode,
                )
        per_step = LAYERS * 2  # layers x micro-batches
        assert [r["attn_fwd_kernels"] for r in records["none"]] == [[per_step]] * 2, attn
        assert [r["attn_fwd_kernels"] for r in records["remat"]] == [[per_step]] * 2, attn
        assert [r["attn_fwd_kernels"] for r in records["recompute"]] == [[2 * per_step]] * 2, attn
