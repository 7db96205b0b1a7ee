"""Accelerate's device mesh: DistCA's attention servers are the data-parallel ranks of the mesh, and the mesh
dimensions it cannot serve (tensor, context and sequence parallelism) are refused before any step.

On 2 and 4 gloo processes, the mesh Accelerate builds for ``ParallelismConfig(dp_replicate_size=2)`` and
``(dp_replicate_size=2, dp_shard_size=2)`` (its own ``build_device_mesh``) gives the group the callback uses, and core attention over that group equals the
single-process oracle. Accelerate itself enables a non-trivial mesh only on accelerator devices, so the
Trainer path with a mesh runs on GPUs; here the refusals are checked through ``DistCATrainer`` on one process.
"""

from __future__ import annotations

import pytest
import torch
from accelerate.parallelism_config import ParallelismConfig
from distributed import run_distributed
from oracle import Layout, assert_close, oracle_with_grads, pack_sequential, random_qkv

from hf_distca import DistCAConfig, core_attention
from hf_distca.validation import attention_server_group, check_parallelism

DOCS = [70, 9, 41, 24]
HQ, HKV, D = 4, 2, 8


def _mesh_case(rank: int, world: int, sizes: dict) -> dict:
    config = ParallelismConfig(**sizes)
    mesh = config.build_device_mesh("cpu")
    group, group_rank, group_size = attention_server_group(mesh, config)
    layout = Layout("seq", list(range(len(DOCS))), DOCS, pack_sequential(DOCS, world))
    q_all, k_all, v_all, w_all = random_qkv(layout.total, HQ, HKV, D, torch.float64, seed=3)
    rows = torch.as_tensor(layout.rows(rank))
    q, k, v = (t[rows].clone().requires_grad_(True) for t in (q_all, k_all, v_all))
    cfg = DistCAConfig(shard_tokens=8, tolerance=0.05, backend="reference")
    out = core_attention(q, k, v, layout.pieces[rank], group=group, config=cfg, all_pieces=layout.pieces)
    (out * w_all[rows]).sum().backward()
    return {
        "group_rank": group_rank,
        "group_size": group_size,
        "group_ranks": torch.distributed.get_process_group_ranks(group),
        "rows": rows,
        "out": out.detach(),
        "grads": [t.grad for t in (q, k, v)],
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "sizes", [{"dp_replicate_size": 2}, {"dp_replicate_size": 2, "dp_shard_size": 2}], ids=["ddp", "hsdp"]
)
def test_attention_group_from_accelerate_mesh_matches_oracle(sizes):
    world = ParallelismConfig(**sizes).total_size
    results = run_distributed(_mesh_case, world, sizes, timeout=150)
    q_all, k_all, v_all, w_all = random_qkv(sum(DOCS), HQ, HKV, D, torch.float64, seed=3)
    ref_out, *ref_grads = oracle_with_grads(q_all, k_all, v_all, w_all, DOCS)
    for rank, res in enumerate(results):
        assert (res["group_rank"], res["group_size"]) == (rank, world)
        assert res["group_ranks"] == list(range(world))
        assert_close(res["out"], ref_out[res["rows"]], "fp64", f"rank {rank} output")
        for name, grad, ref in zip("qkv", res["grads"], ref_grads):
            assert_close(grad, ref[res["rows"]], "fp64", f"rank {rank} d{name}")


def test_attention_group_without_mesh_is_the_world():
    assert attention_server_group(None, None) == (None, 0, 1)  # no process group in this process
    assert attention_server_group(None, ParallelismConfig()) == (None, 0, 1)


@pytest.mark.parametrize(
    "sizes, words",
    [
        ({"cp_size": 2, "dp_shard_size": 2}, ["cp_size=2", "whole-row causal", "dp_shard_size"]),
        ({"sp_size": 2}, ["sp_size=2", "Ulysses", "sequence_parallel_long_docs.py"]),
        ({"tp_size": 2, "dp_shard_size": 2}, ["tp_size=2", "not supported", "dp_shard_size"]),
    ],
)
def test_refuses_mesh_dimensions_distca_cannot_serve(sizes, words):
    with pytest.raises(ValueError) as err:
        check_parallelism(ParallelismConfig(**sizes))
    for word in words:
        assert word in str(err.value)


def test_refuses_a_tensor_parallel_model():
    with pytest.raises(ValueError, match="tp_size=4"):
        check_parallelism(None, model_tp_size=4)
    check_parallelism(ParallelismConfig(dp_replicate_size=2, dp_shard_size=2), model_tp_size=None)  # DP: fine


def test_distca_trainer_refuses_context_parallel_before_accelerate(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    import hf_distca

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="distca")
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], parallelism_config=ParallelismConfig(cp_size=2)
    )
    with pytest.raises(ValueError, match="cp_size=2"):
        hf_distca.DistCATrainer(
            model=model,
            args=args,
            train_dataset=[{"input_ids": list(range(40))}],
            callbacks=[hf_distca.DistCACallback(tokens_per_rank=128)],
        )
