"""Dispatched core attention vs the local varlen kernel on a skewed layout (run with torchrun on N GPUs).

Default layout (2 ranks): rank 0 holds one 64K-token document, rank 1 holds 32 documents of 2K;
Llama-3-8B attention shape (32 query heads, 8 KV heads, head_dim 128), bf16. Reports the planned
imbalance before/after, the time of one forward+backward of (a) every rank running its own documents
locally (the straggler: step time = slowest rank) and (b) hf_distca.core_attention, the bytes each rank
sent, and peak memory per rank. Also checks (b) against (a) output and gradients (the local kernel is
exact for whole documents) in bf16 tolerance, so a fast wrong answer cannot pass.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 -m benchmarks.bench_engine --out benchmarks/results/engine_2xh200.md
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from hf_distca import DistCAConfig, core_attention, local_attention, metrics
from hf_distca.engine import engine_state, probe
from hf_distca.planning import plan_core_attention

from .common import init_nccl, median_ms

BF16_TOL = 2e-2  # max |a - b| / max |b|, bf16 vs bf16 with different summation orders


def skewed_layout(world: int, long_doc: int, short_doc: int) -> list[list[tuple[int, int, int]]]:
    """Rank 0: one long document; every other rank: short documents with the same token count."""
    layout = [[(0, 0, long_doc)]]
    doc = 1
    for _ in range(1, world):
        pieces = []
        for _ in range(long_doc // short_doc):
            pieces.append((doc, 0, short_doc))
            doc += 1
        layout.append(pieces)
    return layout


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--long-doc", type=int, default=65536)
    p.add_argument("--short-doc", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--tolerance", type=float, default=None, help="DistCAConfig.tolerance (default: its default)"
    )
    p.add_argument("--out", default=None, help="markdown file for the results table (rank 0 writes it)")
    args = p.parse_args()
    started = init_nccl("bench_engine.py")
    if started is None:
        return 2
    rank, world = started
    layout = skewed_layout(world, args.long_doc, args.short_doc)
    pieces = layout[rank]
    tokens = sum(n for _, _, n in pieces)
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    shape_q, shape_kv = (tokens, args.heads, args.head_dim), (tokens, args.kv_heads, args.head_dim)
    q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    dout = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = [n for _, _, n in pieces]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    config = DistCAConfig(tolerance=args.tolerance)
    probe(config, device=q.device, dtypes=[q.dtype], q_heads=args.heads, kv_heads=args.kv_heads,
          head_dim=args.head_dim)  # the engine's start-up probes (collective)  # fmt: skip

    def local_step():
        out = local_attention(q, k, v, cu, cu, max(lens), max(lens))
        out.backward(dout)

    def distca_step():
        out = core_attention(q, k, v, pieces, config=config, all_pieces=layout)
        out.backward(dout)

    # correctness first: DistCA vs the local kernel (exact reference for whole documents)
    ref = local_attention(q, k, v, cu, cu, max(lens), max(lens))
    ref.backward(dout)
    ref_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    engine_state().reset()
    metrics.reset()
    out = core_attention(q, k, v, pieces, config=config, all_pieces=layout)
    out.backward(dout)
    stats = metrics.snapshot(reset=True)
    errors = [rel_err(out, ref)] + [rel_err(t.grad, r) for t, r in zip((q, k, v), ref_grads, strict=True)]
    ok = torch.tensor([float(max(errors) <= BF16_TOL)], device="cuda")
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)

    elem = 2
    plan = plan_core_attention(
        layout,
        q_row_bytes=args.heads * args.head_dim * elem,
        kv_row_bytes=2 * args.kv_heads * args.head_dim * elem,
        options=config.planner_options(),
    )
    for t in (q, k, v):
        t.grad = None
    torch.cuda.reset_peak_memory_stats()
    t_local = median_ms(local_step, args.iters, args.warmup, events=True)
    mem_local = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    t_distca = median_ms(distca_step, args.iters, args.warmup, events=True)
    mem_distca = torch.cuda.max_memory_allocated() / 2**30
    mems = torch.tensor([mem_local, mem_distca, float(stats.bytes_sent)], device="cuda")
    everyone = [torch.zeros_like(mems) for _ in range(world)]
    dist.all_gather(everyone, mems)
    errs = torch.tensor(errors, device="cuda")
    all_errs = [torch.zeros_like(errs) for _ in range(world)]
    dist.all_gather(all_errs, errs)

    if rank == 0:
        lines = [
            f"## Dispatched core attention vs local kernel, {world} x {torch.cuda.get_device_name()}",
            "",
            f"Command: `NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node {world} -m benchmarks.bench_engine "
            f"--long-doc {args.long_doc} --short-doc {args.short_doc} --iters {args.iters}`",
            f"torch {torch.__version__}, bf16, {args.heads} query heads / {args.kv_heads} KV heads x "
            f"{args.head_dim}; rank 0: one {args.long_doc}-token document, other ranks: "
            f"{args.long_doc // args.short_doc} documents of {args.short_doc}.",
            "",
            "| | local varlen kernel (no balancing) | hf_distca.core_attention |",
            "|---|---|---|",
            f"| attention load max/mean (planned) | {plan.imbalance_before:.3f} | {plan.imbalance_after:.3f} |",
            f"| forward+backward, slowest rank (ms, median of {args.iters}) | {t_local:.2f} | {t_distca:.2f} |",
            f"| speedup | 1.00x | {t_local / t_distca:.2f}x |",
        ]
        for r, m in enumerate(everyone):
            lines.append(
                f"| rank {r}: peak memory (GiB) / bytes sent per fwd+bwd (MiB) | {m[0].item():.2f} / 0 | "
                f"{m[1].item():.2f} / {m[2].item() / 2**20:.1f} |"
            )
        lines += [
            "",
            f"Correctness (vs local kernel, max relative error, tolerance {BF16_TOL}): "
            + ", ".join(
                f"rank {r}: out {e[0]:.2e} dq {e[1]:.2e} dk {e[2]:.2e} dv {e[3]:.2e}"
                for r, e in enumerate(all_errs)
            )
            + (" — PASS" if ok.item() == 1.0 else " — FAIL"),
            "",
        ]
        text = "\n".join(lines)
        print(text)
        if args.out:
            with open(args.out, "a") as f:
                f.write(text + "\n")
    dist.destroy_process_group()
    return 0 if ok.item() == 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
