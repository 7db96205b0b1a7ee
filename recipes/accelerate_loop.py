"""DistCA in a plain Accelerate training loop (no Trainer): the same pieces the callback uses.

    torchrun --standalone --nproc-per-node 2 recipes/accelerate_loop.py --tokens-per-rank 1024

Per step: every rank builds its share of the same global batch (``DistCABatches``), the model's
``distca`` attention dispatches core attention over the ranks (``enable_distca``), and the loss is
token-weighted over the whole global batch (every micro-batch of every rank), so the losses equal a
single-process run of the same global batch, also with gradient accumulation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import send_to_device
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_distca
from hf_distca.cli import add_config_arguments, config_from_args
from hf_distca.data import DistCABatches, DistCADataLoader, documents_with_lengths, generate_documents

VOCAB = 256


def add_loop_arguments(p: argparse.ArgumentParser, *, tokens_per_rank: int, num_documents: int) -> None:
    """The arguments :func:`rank_batches`, :func:`run_steps` and :func:`finish` read, and the documents'
    count, seed and learning rate (defaults: ``tokens_per_rank`` and ``num_documents`` as given)."""
    p.add_argument("--tokens-per-rank", type=int, default=tokens_per_rank)
    p.add_argument("--max-steps", type=int, default=5)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--num-documents", type=int, default=num_documents)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--learning-rate", type=float, default=0.5)
    p.add_argument("--losses-file", default=None, help="write the per-step losses here (JSON list, rank 0)")


def train_step(accelerator: Accelerator, model, optimizer, step_batches: list[dict]) -> float:
    """One optimizer step over this rank's micro-batches of one global batch; returns the step's loss.

    The loss is token-weighted over the whole global batch (all micro-batches, all ranks), so each
    micro-batch's loss is divided by the global target count, never by the accumulation steps again:
    build the Accelerator without ``gradient_accumulation_steps``. Gradients are summed locally over the
    micro-batches and all-reduced once, with the last one."""
    world = accelerator.num_processes
    local = sum(int(b["shift_labels"].ne(-100).sum()) for b in step_batches)
    total = accelerator.reduce(torch.tensor(local, device=accelerator.device), reduction="sum").item()
    step_loss = torch.zeros((), device=accelerator.device)
    for i, batch in enumerate(step_batches):
        batch = send_to_device(batch, accelerator.device)
        last = i == len(step_batches) - 1
        with contextlib.nullcontext() if last else accelerator.no_sync(model):
            # with DistCAConfig.layer_ping_pong the batch holds two nano-batches: their forwards interleave
            loss = hf_distca.nano_batch_loss(model, batch, num_items_in_batch=total)
            # DDP averages gradients over ranks; scale so the sum over ranks is the global mean
            accelerator.backward(loss * world)
        step_loss += loss.detach().float()
    optimizer.step()
    optimizer.zero_grad()
    return accelerator.reduce(step_loss, reduction="sum").item()


def rank_batches(accelerator: Accelerator, documents, args: argparse.Namespace) -> DistCABatches:
    """This process's share of every global batch of ``documents`` (args: tokens_per_rank, grad_accum, seed,
    max_steps)."""
    rank, world = accelerator.process_index, accelerator.num_processes
    return DistCABatches(
        documents,
        rank=rank,
        world_size=world,
        tokens_per_rank=args.tokens_per_rank,
        grad_accum=args.grad_accum,
        seed=args.seed,
        max_steps=args.max_steps,
        nano_batches=2 if getattr(args, "layer_ping_pong", False) else 1,  # DistCAConfig.layer_ping_pong
        prefetch_plans=getattr(args, "prefetch_plans", False),  # DistCAConfig.prefetch_plans
        pad_to_budget=getattr(args, "pad_to_budget", False),  # DistCAConfig.pad_to_budget
    )


def run_steps(
    accelerator: Accelerator,
    model,
    optimizer,
    batches: DistCABatches,
    grad_accum: int,
    observe: Callable[[list[dict]], None] | None = None,
) -> list[float]:
    """Train over every step of ``batches`` (``grad_accum`` micro-batches each, :func:`train_step`), printing
    each step's loss on the main process; ``observe(micro_batches)`` sees each step's micro-batches first.
    Returns the losses."""
    losses = []
    micro = iter(DistCADataLoader(batches))  # already one share per rank: not sharded by Accelerate
    for _ in range(batches.steps_per_epoch):
        step_batches = [next(micro) for _ in range(grad_accum)]
        if observe is not None:
            observe(step_batches)
        losses.append(train_step(accelerator, model, optimizer, step_batches))
        if accelerator.is_main_process:
            print(f"step {len(losses)}: loss {losses[-1]:.6f}", flush=True)
    return losses


def finish(accelerator: Accelerator, path: str | None, losses: list[float]) -> list[float]:
    """End the run: the per-step losses as a JSON list at ``path`` (main process; nothing when ``path`` is
    None); returns them."""
    if accelerator.is_main_process and path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(losses, f)
    accelerator.end_training()
    return losses


def main(argv=None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_loop_arguments(p, tokens_per_rank=1024, num_documents=200)
    p.add_argument(
        "--doc-lengths",
        default=None,
        help="JSON list of document lengths: generated documents get lengths drawn from it "
        "(default: a long-tailed distribution, mean 400, max 3000 tokens)",
    )
    add_config_arguments(p)  # every DistCAConfig field, e.g. --shard-tokens
    args = p.parse_args(argv)

    # gradient accumulation is ours: the loss of every micro-batch is already divided by the targets of
    # the whole global batch, so Accelerate must not divide by the accumulation steps again
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    world = accelerator.num_processes
    if args.doc_lengths:
        with open(args.doc_lengths) as f:
            sample = np.asarray(json.load(f), dtype=np.int64)
        lengths = np.random.default_rng(args.seed).choice(sample, size=args.num_documents)
        documents = documents_with_lengths(lengths.tolist(), vocab_size=VOCAB, seed=args.seed)
    else:
        documents = generate_documents(
            args.num_documents, vocab_size=VOCAB, seed=args.seed, mean_length=400, max_length=3000
        )
    batches = rank_batches(accelerator, documents, args)
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="distca")
    group = dist.group.WORLD if world > 1 else None
    hf_distca.enable_distca(model, group=group, config=config_from_args(args))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate)
    model, optimizer = accelerator.prepare(model, optimizer)

    losses = run_steps(accelerator, model, optimizer, batches, args.grad_accum)
    return finish(accelerator, args.losses_file, losses)


if __name__ == "__main__":
    main()
    sys.exit(0)
