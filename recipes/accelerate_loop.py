"""DistCA in a plain Accelerate training loop (no Trainer): the same pieces the callback uses.

    torchrun --standalone --nproc-per-node 2 recipes/accelerate_loop.py --tokens-per-rank 1024

Per step: every rank builds its share of the same global batch (``DistCABatches``), the model's
``distca`` attention dispatches core attention over the ranks (``enable_distca``), and the loss is
token-weighted over the whole global batch, so the losses equal a single-process run with
``--tokens-per-rank`` x world size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_distca
from hf_distca.data import DistCABatches, DistCADataLoader, generate_documents


def main(argv=None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens-per-rank", type=int, default=1024)
    p.add_argument("--max-steps", type=int, default=5)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--num-documents", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--learning-rate", type=float, default=0.5)
    p.add_argument("--shard-tokens", type=int, default=64)
    p.add_argument("--losses-file", default=None, help="write the per-step losses here (JSON list, rank 0)")
    args = p.parse_args(argv)

    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=args.grad_accum)
    world, rank = accelerator.num_processes, accelerator.process_index
    documents = generate_documents(
        args.num_documents, vocab_size=256, seed=args.seed, mean_length=400, max_length=3000
    )
    batches = DistCABatches(
        documents,
        rank=rank,
        world_size=world,
        tokens_per_rank=args.tokens_per_rank,
        grad_accum=args.grad_accum,
        seed=args.seed,
        max_steps=args.max_steps,
    )
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="distca")
    group = dist.group.WORLD if world > 1 else None
    hf_distca.enable_distca(model, group=group, config=hf_distca.DistCAConfig(shard_tokens=args.shard_tokens))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate)
    model, optimizer = accelerator.prepare(model, optimizer)

    losses = []
    micro = iter(DistCADataLoader(batches))  # already one share per rank: not sharded by Accelerate
    for _ in range(len(batches.steps)):
        step_batches = [next(micro) for _ in range(args.grad_accum)]
        # token-weighted loss over the whole global batch (all micro-batches, all ranks)
        local = sum(int(b["shift_labels"].ne(-100).sum()) for b in step_batches)
        total = accelerator.reduce(torch.tensor(local, device=accelerator.device), reduction="sum").item()
        step_loss = torch.zeros((), device=accelerator.device)
        for batch in step_batches:
            batch = {k: v.to(accelerator.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            with accelerator.accumulate(model):
                out = model(**batch, num_items_in_batch=total)
                # DDP averages gradients over ranks; scale so the sum over ranks is the global mean
                accelerator.backward(out.loss * world)
                step_loss += out.loss.detach()
                optimizer.step()
                optimizer.zero_grad()
        losses.append(accelerator.reduce(step_loss, reduction="sum").item())
        if accelerator.is_main_process:
            print(f"step {len(losses)}: loss {losses[-1]:.6f}", flush=True)
    if accelerator.is_main_process and args.losses_file:
        os.makedirs(os.path.dirname(os.path.abspath(args.losses_file)), exist_ok=True)
        with open(args.losses_file, "w") as f:
            json.dump(losses, f)
    accelerator.end_training()
    return losses


if __name__ == "__main__":
    main()
    sys.exit(0)
