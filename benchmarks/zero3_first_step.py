"""Why ZeRO-3's first-step loss differed from DDP's: initial weights and first-step losses side by side.

    torchrun --nproc-per-node 2 -m benchmarks.zero3_first_step --out OUTDIR

Builds the recipe's random-init model (``recipes/finetune_long_docs.py: build_model``, default
Llama-3-8B-shaped with 2 layers, bf16, seed 1) three ways on every rank and compares them:

1. ``ddp``: no DeepSpeed config (what DDP and FSDP2 train);
2. ``zero_init``: after ``TrainingArguments(deepspeed=accelerate_configs/ds_zero3.json)``, so Transformers
   builds it inside ``deepspeed.zero.Init`` (what the recipe did under ZeRO-3 before ``built_whole``);
3. ``whole``: the same DeepSpeed config, built by the recipe as it is now (``built_whole``).

For each: a checksum of every parameter and buffer (gathered when partitioned; sha256 of the bytes),
and the next-token loss of one fixed batch (random tokens, ``--tokens`` per rank, token-weighted over
ranks) from a plain forward of the full weights (with and without bf16 autocast, as the Trainer runs
DDP with ``bf16=True``) and through a DeepSpeed ZeRO-3 engine (bf16, as the Trainer runs ZeRO-3).
Writes ``OUTDIR/zero3_first_step.json`` and ``OUTDIR/zero3_first_step.md``. ``--cpu`` with
``--model tiny-llama`` runs it over gloo on a CPU machine (a check of the script, not a result).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .common import ROOT, load_recipe


def checksums(model) -> dict[str, dict]:
    """Per parameter/buffer: sha256 of its bytes, float64 sum and L2 norm (full tensors, every rank)."""
    import deepspeed

    out = {}
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            data = t.detach().contiguous().cpu()
            raw = data.reshape(-1).view(torch.uint8) if data.numel() else data.reshape(-1)
            out[name] = {
                "sha256": hashlib.sha256(raw.numpy().tobytes()).hexdigest(),
                "dtype": str(data.dtype).removeprefix("torch."),
                "shape": list(data.shape),
                "sum": float(data.double().sum()),
                "norm": float(data.double().norm()),
            }
    return out


def global_loss(loss_sum: torch.Tensor, count: int, device) -> float:
    """Token-weighted mean over ranks of per-rank summed losses."""
    both = torch.tensor([float(loss_sum), float(count)], dtype=torch.float64, device=device)
    dist.all_reduce(both)
    return float(both[0] / both[1])


def batch_loss_sum(model_or_engine, ids: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross entropy of one row (1, T), logits upcast to fp32 as Transformers does."""
    with torch.no_grad():
        logits = model_or_engine(input_ids=ids, use_cache=False).logits  # (1, T, V)
        return F.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum")


def plain_losses(model, ids, device, autocast_device: str) -> dict[str, float]:
    """Loss of the full weights in a plain forward, without and with bf16 autocast."""
    import deepspeed

    out = {}
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        out["plain"] = global_loss(batch_loss_sum(model, ids), ids.shape[1] - 1, device)
        with torch.autocast(autocast_device, dtype=torch.bfloat16):
            out["plain_autocast"] = global_loss(batch_loss_sum(model, ids), ids.shape[1] - 1, device)
    return out


def engine_loss(model, ids, device, cpu: bool) -> float:
    """Loss through a DeepSpeed ZeRO-3 engine (bf16), the way the Trainer runs ZeRO-3 forwards."""
    import deepspeed

    config = {
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": not cpu},
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
    }
    engine = deepspeed.initialize(model=model, config=config)[0]
    engine.eval()
    loss = global_loss(batch_loss_sum(engine, ids), ids.shape[1] - 1, device)
    if hasattr(engine, "destroy"):
        engine.destroy()
    return loss


def compare(a: dict[str, dict], b: dict[str, dict]) -> list[str]:
    """Names of tensors whose bytes differ."""
    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))[:5]
    return [n for n in a if a[n]["sha256"] != b[n]["sha256"]]


def overall(sums: dict[str, dict]) -> str:
    h = hashlib.sha256()
    for name in sorted(sums):
        h.update(f"{name}:{sums[name]['sha256']};".encode())
    return h.hexdigest()[:16]


def report(results: dict) -> str:
    loss = results["losses"]
    ref = loss["ddp"]["plain_autocast"]
    rel = lambda x: f"{(x - ref) / abs(ref):+.2e}"  # noqa: E731
    lines = [
        "# ZeRO-3 vs DDP first-step loss: initial weights and losses",
        "",
        f"{results['environment']}",
        "",
        f"Command: `{results['command']}`",
        "",
        "| build | weights checksum | tensors differing from ddp | loss, plain forward | + bf16 autocast "
        "(vs ddp) | through a ZeRO-3 engine (vs ddp) |",
        "|---|---|---|---|---|---|",
    ]
    for build in ("ddp", "zero_init", "whole"):
        differ = results["differing_from_ddp"][build]
        lines.append(
            f"| {build} | {results['checksum'][build]} | {len(differ)} of {results['num_tensors']}"
            f"{' (' + ', '.join(differ[:3]) + (', ...' if len(differ) > 3 else '') + ')' if differ else ''} | "
            f"{loss[build]['plain']:.6f} | {loss[build]['plain_autocast']:.6f} ({rel(loss[build]['plain_autocast'])}) | "
            f"{loss[build]['engine']:.6f} ({rel(loss[build]['engine'])}) |"
        )
    lines += [
        "",
        "ddp: no DeepSpeed config (DDP, FSDP2). zero_init: built inside deepspeed.zero.Init (the recipe under",
        "ZeRO-3 before `built_whole`). whole: the recipe now, under the same DeepSpeed config. Losses: mean",
        f"next-token cross entropy of one fixed batch of random tokens ({results['tokens']} per rank, "
        f"{results['world_size']} ranks), before any update.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="llama3-8b-shaped", help="a built-in model of the recipe")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank of the fixed batch")
    p.add_argument("--vocab", type=int, default=2048, help="the tokenizer size the recipe would pass")
    p.add_argument(
        "--deepspeed",
        default=os.path.join(ROOT, "accelerate_configs", "ds_zero3.json"),
        help="DeepSpeed JSON",
    )
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU, fp32 (a check of the script)")
    args = p.parse_args(argv)

    import deepspeed
    import transformers
    from transformers import TrainingArguments
    from transformers.integrations import is_deepspeed_zero3_enabled

    recipe = load_recipe()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.cpu:
        deepspeed.init_distributed(dist_backend="gloo")
        device, dtype = torch.device("cpu"), torch.float32
    else:
        torch.cuda.set_device(local_rank)
        deepspeed.init_distributed(dist_backend="nccl")
        device, dtype = torch.device("cuda", local_rank), torch.bfloat16
    rank, world = dist.get_rank(), dist.get_world_size()
    recipe_argv = ["--model", args.model, "--num-layers", str(args.num_layers), "--seed", str(args.seed)]
    recipe_argv += ["--attn", "sdpa", "--bf16"] + (["--cpu"] if args.cpu else [])
    recipe_args = recipe.parse_args(recipe_argv)
    gen = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, args.vocab, (1, args.tokens), generator=gen).to(device)  # (1, T)
    autocast_device = device.type

    sums, losses = {}, {}
    # 1. ddp: no DeepSpeed config anywhere yet
    assert not is_deepspeed_zero3_enabled()
    model = recipe.build_model(recipe_args, args.vocab, dtype)
    sums["ddp"] = checksums(model)
    losses["ddp"] = plain_losses(model, ids, device, autocast_device)
    losses["ddp"]["engine"] = engine_loss(model, ids, device, args.cpu)
    del model

    with tempfile.TemporaryDirectory() as tmp:
        training_args = TrainingArguments(
            output_dir=tmp,
            deepspeed=args.deepspeed,
            bf16=not args.cpu,
            use_cpu=args.cpu,
            per_device_train_batch_size=1,
            report_to=[],
        )
        assert is_deepspeed_zero3_enabled(), "the DeepSpeed config does not enable ZeRO-3"
        # 2. zero_init: the recipe's build without training_args, i.e. inside deepspeed.zero.Init
        model = recipe.build_model(recipe_args, args.vocab, dtype)
        partitioned = sum(1 for p in model.parameters() if p.numel() == 0)
        sums["zero_init"] = checksums(model)
        losses["zero_init"] = plain_losses(model, ids, device, autocast_device)
        losses["zero_init"]["engine"] = engine_loss(model, ids, device, args.cpu)
        del model
        # 3. whole: the recipe as it is
        model = recipe.build_model(recipe_args, args.vocab, dtype, training_args)
        sums["whole"] = checksums(model)
        losses["whole"] = plain_losses(model, ids, device, autocast_device)
        losses["whole"]["engine"] = engine_loss(model, ids, device, args.cpu)
        del model

    if rank == 0:
        gpu = "CPU" if args.cpu else torch.cuda.get_device_name(device)
        results = {
            "environment": (
                f"{world} x {gpu}; Python {platform.python_version()}, torch {torch.__version__}, "
                f"transformers {transformers.__version__}, deepspeed {deepspeed.__version__}"
            ),
            "command": "torchrun --nproc-per-node 2 -m benchmarks.zero3_first_step " + " ".join(sys.argv[1:]),
            "world_size": world,
            "tokens": args.tokens,
            "num_tensors": len(sums["ddp"]),
            "zero_init_partitioned_parameters": partitioned,
            "checksum": {k: overall(v) for k, v in sums.items()},
            "differing_from_ddp": {k: compare(sums["ddp"], v) for k, v in sums.items()},
            "losses": losses,
            "tensors": sums,
        }
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "zero3_first_step.json"), "w") as f:
            json.dump(results, f, indent=1)
        text = report(results)
        with open(os.path.join(args.out, "zero3_first_step.md"), "w") as f:
            f.write(text)
        print(text, flush=True)
    dist.barrier()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
