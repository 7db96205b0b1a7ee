"""The engine's equality test on GPUs over NCCL, bf16 (run with torchrun; not collected by pytest).

Every rank's outputs and q/k/v gradients are compared with the single-process float64 oracle of
tests/oracle.py on the layout zoo, plus a Llama-3-8B-shaped case (32/8 heads x 128). Exit code 0 only
when every comparison is within the bf16 tolerance.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 tests/gpu_nccl_engine_check.py
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from oracle import Layout, named_layouts, oracle_with_grads, random_qkv  # noqa: E402
from tolerances import TOL  # noqa: E402

from hf_distca import DistCAConfig, core_attention  # noqa: E402

# bf16 inputs and kernels vs the float64 oracle: max |a - b| <= BF16_TOL * max |b| per tensor.
BF16_TOL = TOL["gpu_engine"][0]


def check(layout: Layout, heads: int, kv_heads: int, dim: int, shard: int, seed: int) -> list[str]:
    rank = dist.get_rank()
    q, k, v, w = random_qkv(layout.total, heads, kv_heads, dim, torch.bfloat16, seed)
    ref = oracle_with_grads(q.double(), k.double(), v.double(), w.double(), layout.doc_lens)
    # oracle rows are in doc_ids order; map this rank's local tokens to them
    rows = torch.as_tensor(layout.rows(rank))
    local = [t[rows].cuda().requires_grad_(True) for t in (q, k, v)]
    out = core_attention(*local, layout.pieces[rank], config=DistCAConfig(shard_tokens=shard))
    (out.float() * w[rows].cuda().float()).sum().backward()
    failures = []
    for name, got, want in zip(
        ("out", "dq", "dk", "dv"), (out, *(t.grad for t in local)), (r[rows] for r in ref), strict=True
    ):
        if want.numel() == 0:  # a rank without tokens
            continue
        if got is None:
            failures.append(f"{layout.name} rank {rank} {name}: no gradient")
            continue
        scale = want.abs().max().clamp_min(1e-6)
        err = float((got.double().cpu() - want).abs().max() / scale)
        if not err <= BF16_TOL:
            failures.append(
                f"{layout.name} H={heads}/{kv_heads} D={dim} rank {rank} {name}: rel err {err:.3e}"
            )
    return failures


def main() -> int:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    failures, cases = [], 0
    for layout in named_layouts(world, seed=7):
        failures += check(layout, 4, 2, 16, shard=16, seed=11)
        cases += 1
    big = Layout(
        "llama3-8b-shape", [0, 1, 2], [3072, 512, 1536], [[(0, 0, 3072)]] + [[] for _ in range(world - 1)]
    )
    big.pieces[world - 1] += [(1, 0, 512), (2, 0, 1536)]
    failures += check(big, 32, 8, 128, shard=128, seed=13)
    cases += 1
    flag = torch.tensor([len(failures)], device="cuda")
    dist.all_reduce(flag)
    for f in failures:
        print("FAIL", f, flush=True)
    if dist.get_rank() == 0:
        status = "PASS" if flag.item() == 0 else "FAIL"
        print(f"gpu_nccl_engine_check: {cases} layouts x {world} ranks, bf16 tolerance {BF16_TOL}: {status}")
    dist.destroy_process_group()
    return 0 if flag.item() == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
