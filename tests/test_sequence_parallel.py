"""The sequence-parallel baselines of the benchmark suite (recipes/sequence_parallel_long_docs.py) on the CPU.

- DeepSpeed Ulysses / ALST through Accelerate (``sp_size``): the recipe on 2 gloo
  processes trains exactly like finetune_long_docs.py on one process (per-step losses), and its attention
  layer, ``UlyssesSPAttentionHF`` around hf_distca's document-aware attention, gives the per-document
  oracle's outputs and gradients; around SDPA (the core that needs no extra package) documents leak.
- torch context parallelism through Accelerate (``cp_size``): Accelerate's attention hook replaces the
  document mask of a packed batch with whole-row causal attention (documents see each other: not exact),
  and torch's context parallel has no CPU SDPA kernel (it is run on GPUs only, by the suite).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from distributed import run_distributed, skip_deepspeed_shm_build
from extras import require
from oracle import assert_close, oracle_attention, oracle_with_grads, random_qkv
from run_recipes import launch
from tolerances import TOL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "recipes"))
import sequence_parallel_long_docs as sp_recipe  # noqa: E402

from hf_distca.data.loader import DistCABatches  # noqa: E402

DOC_LENS = [37, 80, 11, 100]  # one packed row of 228 tokens; shards of 114 cut the second document
SEED = 5


# ------------------------------------------------------------------ attention layer, 2 gloo processes
def _shard(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = x.shape[0] // world
    return x[rank * n : (rank + 1) * n]


def _ulysses_call(rank, world, attn, hq, hkv, seed):
    """UlyssesSPAttentionHF(attn) on this rank's contiguous shard of one packed row; returns the rank's
    output and the gradients of its q/k/v shards for a fixed random output weight."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    total, d = sum(DOC_LENS), 16
    q, k, v, weight = random_qkv(total, hq, hkv, d, torch.float32, seed)  # (T, H, D)
    positions = torch.cat([torch.arange(n) for n in DOC_LENS])[None]  # (1, T)
    layer = UlyssesSPAttentionHF(attn, batch_size=1, attn_head_count=hq, attn_head_size=d, kv_head_count=hkv,
                                 num_hidden_layers=1, process_group=torch.distributed.group.WORLD,
                                 seq_length_is_variable=True)  # fmt: skip
    module = torch.nn.Module()  # what the attention functions read from the Transformers module
    module.is_causal, module.num_key_value_groups = True, hq // hkv
    shards = [_shard(t, rank, world).clone().requires_grad_() for t in (q, k, v)]
    bhsd = [s.transpose(0, 1)[None] for s in shards]  # (1, H, T / world, D)
    out, _ = layer(module, *bhsd, None, scaling=d**-0.5, position_ids=_shard(positions.T, rank, world).T)
    out = out.reshape(-1, hq, d)  # (T / world, Hq, D)
    (out * _shard(weight, rank, world)).sum().backward()
    return out.detach(), [s.grad for s in shards]


def _attention_cases(rank, world):
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hf_distca.attention import distca_attention_forward

    skip_deepspeed_shm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for hq, hkv in ((4, 2), (4, 1)):  # KV heads divide sp_size; fewer KV heads than ranks (replicated)
        results[("distca", hq, hkv)] = _ulysses_call(rank, world, distca_attention_forward, hq, hkv, SEED)
    results[("sdpa", 4, 2)] = _ulysses_call(rank, world, sdpa_attention_forward, 4, 2, SEED)
    refusals = {}
    for hq, hkv in ((3, 3), (6, 3)):  # heads or KV heads that sp_size does not divide
        try:
            _ulysses_call(rank, world, distca_attention_forward, hq, hkv, seed=0)
        except ValueError as err:
            refusals[(hq, hkv)] = str(err)
    # torch context parallelism (what Accelerate's cp_size runs) on the CPU
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    q, k, v = (torch.randn(1, 2, 64, 8) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        refusals["torch-cp"] = None
    except NotImplementedError as err:
        refusals["torch-cp"] = str(err)
    return results, refusals


def test_ulysses_attention_layer_exact_with_document_attention():
    require("deepspeed", "deepspeed")
    ranks = run_distributed(_attention_cases, 2)
    world = len(ranks)
    for core, hq, hkv in ranks[0][0]:
        q, k, v, weight = random_qkv(sum(DOC_LENS), hq, hkv, 16, torch.float32, SEED)
        out = torch.cat([r[0][(core, hq, hkv)][0] for r in ranks])  # (T, Hq, D), shards in rank order
        grads = [torch.cat([r[0][(core, hq, hkv)][1][i] for r in ranks]) for i in range(3)]
        if core == "distca":
            ref, *ref_grads = oracle_with_grads(q, k, v, weight, DOC_LENS)
            assert_close(out, ref, "fp32", f"Ulysses output, {hq}/{hkv} heads")
            for name, got, expected in zip("qkv", grads, ref_grads):
                assert_close(got, expected, "fp32", f"d{name}, {hq}/{hkv} heads")
        else:  # SDPA with the mask dropped: causal over the whole row, documents see each other
            whole = oracle_attention(q.double(), k.double(), v.double(), [sum(DOC_LENS)])
            per_doc = oracle_attention(q.double(), k.double(), v.double(), DOC_LENS)
            assert_close(out, whole, "fp32", "Ulysses + SDPA vs whole-row causal attention")
            first = DOC_LENS[0]
            assert_close(out[:first], per_doc[:first], "fp32", "the first document sees nothing else")
            assert (out[first:] - per_doc[first:]).abs().max() > 1e-2  # later documents see earlier ones
    for _, refusals in ranks:
        assert "Attention head count 3 is not divisible by SP size 2" in refusals[(3, 3)]
        assert "KV attention head count 3 is not divisible by SP size 2" in refusals[(6, 3)]
        assert "_scaled_dot_product_flash_attention_for_cpu" in refusals["torch-cp"]
    assert world == 2


# ------------------------------------------------------------- torch CP's mask handling, one process
def test_accelerate_context_parallel_drops_document_boundaries():
    """Accelerate's cp_size path attaches a hook to every attention module that replaces the attention
    mask with ``is_causal=True`` (accelerate.big_modeling._attach_context_parallel_hooks, attached by
    Accelerator._prepare_cp), after the Trainer has accepted a document mask as causal: with the
    block-diagonal causal mask of a packed batch (the way to keep SDPA inside documents), the second
    document then sees the first. (Without a mask, Transformers 5.24's SDPA path attends causally over the
    whole packed row anyway: position_ids alone do not separate documents for SDPA.)"""
    from accelerate.big_modeling import _attach_context_parallel_hooks
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.trainer_pt_utils import is_attention_mask_causal

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=50, initializer_range=0.2)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    lengths = [40, 30]
    ids = torch.randint(0, 50, (1, sum(lengths)))
    other = ids.clone()
    other[0, : lengths[0]] = torch.randint(0, 50, (lengths[0],))  # another first document
    positions = torch.cat([torch.arange(n) for n in lengths])[None]  # (1, T), restarting per document
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))  # (T,) document ids
    mask = (doc[:, None] == doc[None, :]) & torch.ones(len(doc), len(doc), dtype=torch.bool).tril()  # (T, T)
    mask = mask[None, None]  # (1, 1, T, T): query i sees key j of its own document, j <= i
    assert is_attention_mask_causal(mask)  # the Trainer's context-parallel check lets it through

    def second_document_logits(batch):
        with torch.no_grad():
            return model(input_ids=batch, position_ids=positions, attention_mask=mask).logits[0, lengths[0] :]

    plain = second_document_logits(ids), second_document_logits(other)
    rtol, atol = TOL["logits"]
    torch.testing.assert_close(plain[0], plain[1], rtol=rtol, atol=atol)  # the mask keeps documents apart
    _attach_context_parallel_hooks(model)
    hooked = second_document_logits(ids), second_document_logits(other)
    assert (hooked[0] - hooked[1]).abs().max() > 1e-2  # the first document leaks into the second
    assert (hooked[0] - plain[0]).abs().max() > 1e-2


# -------------------------------------------------------------------------- recipe, data and training
def test_packed_rows_are_the_distca_global_batches(tmp_path, monkeypatch, capsys):
    lengths = tmp_path / "lens.json"
    lengths.write_text(json.dumps([300, 700, 1500, 2600, 120]))
    args = sp_recipe.parse_args(["--doc-lengths", str(lengths), "--num-documents", "30", "--tokens-per-rank",
                                 "1024", "--max-steps", "3", "--grad-accum", "2"])  # fmt: skip
    documents, _ = sp_recipe.base.documents_from_lengths(args)
    rows = sp_recipe.packed_rows(documents, args, world=2)
    loader = DistCABatches(documents, rank=0, world_size=1, tokens_per_rank=2048, grad_accum=2, seed=0,
                           max_steps=3, pad_to_budget=True)  # fmt: skip
    expected = list(loader)
    assert len(rows) == len(expected) == 6
    for row, batch in zip(rows, expected):
        assert row["input_ids"].shape == (1, 2048) and torch.equal(row["input_ids"], batch["input_ids"])
        assert torch.equal(row["position_ids"], batch["position_ids"])
        # what DeepSpeed's adapter does to labels (shift left, pad -100) gives back DistCA's targets
        shifted = torch.nn.functional.pad(row["labels"][:, 1:], (0, 1), value=-100)
        assert torch.equal(shifted, batch["shift_labels"])
        starts = row["position_ids"][0] == 0
        assert (row["labels"][0, starts] == -100).all()
    for argv, message in (
        (["--layout", "balanced"], "--layout balanced"),
        (["--parallelism", "torch-cp"], "pass --attn sdpa"),
        (["--deepspeed", "ds.json"], "its own DeepSpeed config"),
    ):
        with pytest.raises(SystemExit):
            sp_recipe.parse_args(argv)
        assert message in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit, match="needs >= 2 processes"):
        sp_recipe.main([])
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="torch-cp needs CUDA GPUs"):
        sp_recipe.main(["--parallelism", "torch-cp", "--attn", "sdpa", "--cpu"])


def _launch(world: int, script: str, out_dir, *argv: str) -> list[dict]:
    """Run ``script`` (a path under the repository) on ``world`` processes; its metrics records."""
    launch(
        world,
        [[script, [*argv, "--output-dir", str(out_dir)]]],
        out_dir.parent,
        env={"DS_ACCELERATOR": "cpu"},
    )
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_ulysses_recipe_trains_like_one_process(tmp_path):
    """DeepSpeed Ulysses (ZeRO-3, sp_size 2, hf_distca's document attention) through Accelerate and the
    Trainer vs finetune_long_docs.py on one process: same documents, SGD, fp32, 3 steps, equal losses."""
    require("deepspeed", "deepspeed")
    lengths = tmp_path / "lens.json"
    lengths.write_text(json.dumps([300, 700, 1500, 2600, 120, 90, 450, 1000]))
    common = ["--doc-lengths", str(lengths), "--num-documents", "40", "--max-steps", "3", "--optim", "sgd",
              "--learning-rate", "0.5", "--seed", "3", "--no-save"]  # fmt: skip
    ref = _launch(1, "recipes/finetune_long_docs.py", tmp_path / "ref", *common, "--tokens-per-rank", "2048")
    ulysses = _launch(
        2,
        "recipes/sequence_parallel_long_docs.py",
        tmp_path / "sp",
        *common,
        "--tokens-per-rank",
        "1024",
    )
    assert [r["step"] for r in ulysses] == [r["step"] for r in ref] == [1, 2, 3]
    rtol = TOL["train_loss"][0]
    for a, b in zip(ulysses, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=rtol), (a["step"], a["loss"], b["loss"])
    assert ulysses[0]["loss"] != ulysses[-1]["loss"]  # the steps trained
    assert ulysses[0]["bytes_sent"] == [sp_recipe.all_to_all_bytes(_tiny_llama(), 1024, 2, 4, 2)] * 2


def _tiny_llama():
    from transformers import LlamaConfig

    return LlamaConfig(**sp_recipe.base.BUILTIN_MODELS["tiny-llama"])


@pytest.mark.slow
def test_ulysses_recipe_refuses_zero_stages_it_is_not_exact_under(tmp_path):
    """The recipe is exact under ZeRO-3 only (test above): any other stage DeepSpeed builds is refused at the
    first step, with the same message on every rank, before a step could train off the one-process run."""
    require("deepspeed", "deepspeed")
    lengths = tmp_path / "lens.json"
    lengths.write_text(json.dumps([300, 700, 1500, 2600, 120, 90, 450, 1000]))
    argv = ["--doc-lengths", str(lengths), "--num-documents", "40", "--max-steps", "1", "--optim", "sgd",
            "--seed", "3", "--tokens-per-rank", "1024", "--no-save"]  # fmt: skip
    with pytest.raises(AssertionError) as failed:
        _launch(2, "tests/ulysses_zero_stage.py", tmp_path / "z1", "1", *argv)
    report = str(failed.value)
    for rank in (0, 1):
        rank_output = report.split(f"--- rank {rank} ")[1].split("--- rank ")[0]
        assert "exact under DeepSpeed ZeRO-3 only, but the engine runs ZeRO stage 1" in rank_output, (
            rank_output
        )
