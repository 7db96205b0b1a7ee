"""The engine's equality test on GPUs, bf16, over NCCL or gloo (run with torchrun; tests/test_ping_pong.py runs --cpu).

Every rank's outputs and q/k/v gradients are compared with the single-process float64 oracle of
tests/oracle.py on the layout zoo, plus a Llama-3-8B-shaped case (32/8 heads x 128), in every schedule:
serial, and ping-pong with each split (its exchanges in flight while kernels run: a missing wait between
the communication and the compute streams shows as wrong numbers), ``--repeat`` times. Exit code 0 only
when every comparison is within the bf16 tolerance.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 tests/gpu_nccl_engine_check.py

``--ranks-per-node N`` adds the serial and local_first ping-pong schedules with KV through the relay
(``DistCAConfig(kv_relay=True, ranks_per_node=N)``: two chained exchanges per KV phase, the second
started from a side stream on CUDA); they must start more exchanges than the direct serial schedule.

``--backend gloo --one-gpu`` runs every rank on GPU 0 over gloo (CUDA tensors, staged through host memory;
NCCL refuses two ranks on one GPU): the engine's CUDA schedule with asynchronous exchanges on a machine
with a single GPU, not NCCL's.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from oracle import Layout, named_layouts, oracle_with_grads, random_qkv  # noqa: E402
from tolerances import TOL  # noqa: E402

from hf_distca import DistCAConfig, core_attention, metrics  # noqa: E402
from hf_distca.engine import probe  # noqa: E402
from hf_distca.planning.ping_pong import PING_PONG_SPLITS  # noqa: E402

# bf16 inputs and kernels vs the float64 oracle: max |a - b| <= BF16_TOL * max |b| per tensor (b: the whole
# tensor over all ranks, a: this rank's rows).
BF16_TOL = TOL["gpu_engine"][0]
DEVICE = torch.device("cuda")  # this rank's device (main sets it)


# (name, DistCAConfig fields) of every schedule checked
SCHEDULES = [("serial", {"ping_pong": False})] + [
    (f"ping_pong:{split}", {"ping_pong": True, "ping_pong_split": split}) for split in PING_PONG_SPLITS
]


def case(layout: Layout, heads: int, kv_heads: int, dim: int, shard: int, seed: int) -> dict:
    """A case: its layout, shard size, bf16 q, k, v and loss weights, and the float64 oracle's outputs and
    gradients (computed once: every schedule and repeat compares against the same)."""
    q, k, v, w = random_qkv(layout.total, heads, kv_heads, dim, torch.bfloat16, seed)
    ref = oracle_with_grads(q.double(), k.double(), v.double(), w.double(), layout.doc_lens)
    return {"layout": layout, "shard": shard, "inputs": (q, k, v, w), "ref": ref}


def check(layout: Layout, shard: int, inputs: tuple, ref: tuple, schedule: tuple[str, dict]) -> list[str]:
    rank = dist.get_rank()
    q, k, v, w = inputs
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]  # q (T, H, D), k (T, H_kv, D)
    # oracle rows are in doc_ids order; map this rank's local tokens to them
    rows = torch.as_tensor(layout.rows(rank))
    local = [t[rows].to(DEVICE).requires_grad_(True) for t in (q, k, v)]
    name, fields = schedule
    config = DistCAConfig(shard_tokens=shard, **fields)
    # the engine's start-up probes (collective; once per dtype and head shape)
    probe(config, device=DEVICE, dtypes=[q.dtype], q_heads=heads, kv_heads=kv_heads, head_dim=dim)
    out = core_attention(*local, layout.pieces[rank], config=config)
    (out.float() * w[rows].to(DEVICE).float()).sum().backward()
    failures = []
    for tensor, got, whole in zip(
        ("out", "dq", "dk", "dv"), (out, *(t.grad for t in local)), ref, strict=True
    ):
        want = whole[rows]
        if want.numel() == 0:  # a rank without tokens
            continue
        if got is None:
            failures.append(f"{name} {layout.name} rank {rank} {tensor}: no gradient")
            continue
        # bf16 rounding scales with the whole tensor's magnitudes, not with this rank's rows (a rank holding
        # only one-token documents has dq = 0 from the oracle and bf16 noise from any kernel)
        scale = whole.abs().max().clamp_min(1e-6)
        err = float((got.double().cpu() - want).abs().max() / scale)
        if not err <= BF16_TOL:
            failures.append(
                f"{name} {layout.name} H={heads}/{kv_heads} D={dim} rank {rank} {tensor}: rel err {err:.3e}"
            )
    return failures


def parser() -> argparse.ArgumentParser:
    """The check's command line (scripts/first_multi_gpu_run.py's test parses its commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl", help="process group backend")
    p.add_argument("--one-gpu", action="store_true", help="every rank on GPU 0 (gloo only)")
    p.add_argument(
        "--cpu",
        action="store_true",
        help="a smoke run on the CPU, without the large case (tests/test_ping_pong.py)",
    )
    p.add_argument("--repeat", type=int, default=3, help="runs of every case and schedule (races are rare)")
    p.add_argument(
        "--timeout",
        type=int,
        default=600,
        help="seconds a collective may wait before the run fails (default 600)",
    )
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="also check the KV relay with nodes of this many ranks",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.one_gpu and args.cpu:
        p.error("--one-gpu and --cpu exclude each other")
    if (args.one_gpu or args.cpu) and args.backend != "gloo":
        p.error("--one-gpu and --cpu need --backend gloo (NCCL refuses two ranks on one GPU and CPU tensors)")
    global DEVICE
    if args.cpu:
        DEVICE = torch.device("cpu")
    else:
        DEVICE = torch.device("cuda", 0 if args.one_gpu else int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(DEVICE)
    if not dist.is_initialized():
        bound = (
            {"device_id": DEVICE} if args.backend == "nccl" else {}
        )  # the device fixed once, for every collective
        dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout), **bound)
    world = dist.get_world_size()
    schedules = list(SCHEDULES)
    relay = {"kv_relay": True, "ranks_per_node": args.ranks_per_node}
    if args.ranks_per_node is not None:
        schedules += [
            ("relay:serial", {"ping_pong": False, **relay}),
            ("relay:ping_pong:local_first", {"ping_pong": True, "ping_pong_split": "local_first", **relay}),
        ]
    cases = [case(layout, 4, 2, 16, 16, 11) for layout in named_layouts(world, seed=7)]
    if not args.cpu:  # a Llama-3-8B-shaped case (minutes in bf16 on a CPU)
        big = Layout(
            "llama3-8b-shape", [0, 1, 2], [3072, 512, 1536], [[(0, 0, 3072)]] + [[] for _ in range(world - 1)]
        )
        big.pieces[world - 1] += [(1, 0, 512), (2, 0, 1536)]
        cases.append(case(big, 32, 8, 128, 128, 13))
    failures = []
    kernels = torch.zeros(len(schedules), len(cases), dtype=torch.long)  # (schedule, case), this rank
    exchanges = torch.zeros(len(schedules), len(cases), dtype=torch.long)  # all-to-alls started
    exchanged = torch.zeros(len(cases), dtype=torch.long)  # bytes the serial schedule sent, per case
    for _ in range(args.repeat):
        for s, schedule in enumerate(schedules):
            for i, c in enumerate(cases):
                metrics.reset()
                failures += check(**c, schedule=schedule)
                stats = metrics.snapshot()
                kernels[s, i], exchanges[s, i] = stats.attn_fwd_kernels, stats.exchanges
                if s == 0:
                    exchanged[i] = stats.bytes_sent
    # ping-pong really split every case that exchanges: more server kernels over the ranks than serial's;
    # the relay really relayed where KV crosses nodes: more exchanges than the direct serial schedule
    counts = torch.cat([kernels.flatten(), exchanges.flatten(), exchanged]).to(DEVICE)
    dist.all_reduce(counts)
    n = kernels.numel()
    kernels, exchanges = counts[:n].view(kernels.shape).cpu(), counts[n : 2 * n].view(kernels.shape).cpu()
    exchanged = counts[2 * n :].cpu()
    relayed = 0
    direct = {tuple(sorted(fields.items())): s for s, (_, fields) in enumerate(schedules)}
    for s, (name, fields) in enumerate(schedules[1:], start=1):
        for i, c in enumerate(cases):
            if exchanged[i] > 0 and fields["ping_pong"] and not kernels[s, i] > kernels[0, i]:
                failures.append(
                    f"{name} {c['layout'].name}: {kernels[s, i]} server kernels, serial {kernels[0, i]}"
                )
            if fields.get("kv_relay"):  # against the same schedule without the relay
                twin = direct[tuple(sorted((k, v) for k, v in fields.items() if k not in relay))]
                relayed += int(exchanges[s, i] > exchanges[twin, i])
    if args.ranks_per_node is not None and not relayed:
        failures.append(
            "kv_relay: no case started more exchanges than without it (nothing crossed nodes: give fewer "
            "--ranks-per-node than ranks)"
        )
    flag = torch.tensor([len(failures)], device=DEVICE)
    dist.all_reduce(flag)
    for f in failures:
        print("FAIL", f, flush=True)
    if dist.get_rank() == 0:
        status = "PASS" if flag.item() == 0 else "FAIL"
        print(
            f"gpu_nccl_engine_check ({args.backend}{', one GPU' if args.one_gpu else ''}): {len(cases)} layouts x "
            f"{len(schedules)} schedules ({', '.join(n for n, _ in schedules)}) x {args.repeat} runs x {world} "
            f"ranks, bf16 tolerance {BF16_TOL}; server kernels over the ranks per schedule: "
            f"{dict(zip((n for n, _ in schedules), kernels.sum(1).tolist(), strict=True))}, cases exchanging: "
            f"{int((exchanged > 0).sum())}"
            + (f", (schedule, case) pairs relayed: {relayed}" if args.ranks_per_node else "")
            + f": {status}"
        )
    return 0 if flag.item() == 0 else 1


if __name__ == "__main__":
    code = main()
    dist.destroy_process_group()
    sys.exit(code)
