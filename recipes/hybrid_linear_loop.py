"""Train a hybrid model (linear attention + softmax attention) with documents cut across ranks.

    torchrun --standalone --nproc-per-node 2 recipes/hybrid_linear_loop.py --tokens-per-rank 512
    torchrun --standalone --nproc-per-node 2 recipes/hybrid_linear_loop.py --arch qwen3-next

A plain Accelerate loop. Per step every rank builds its share of the same global batch (``DistCABatches``:
documents longer than a rank's share are cut over ranks); the softmax layers run through
attn_implementation="distca" (``enable_distca``) and the linear layers through the cross-rank state
scan (``enable_linear_attention_sp``: All-Scan by default). The loss is token-weighted over the whole
global batch, so the per-step losses equal a single-process run with ``--tokens-per-rank`` x world size.
``--arch``: MiniMax (lightning attention, a per-head constant decay) or Qwen3-Next (gated DeltaNet: a
causal convolution whose rows cross ranks through a halo exchange, then the delta rule, a dense
transition), built from its config with random weights (``--size tiny`` for CPU, ``small`` for a GPU);
``--model`` loads a local checkpoint of either instead.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, MiniMaxConfig, Qwen3NextConfig

import hf_distca
from hf_distca.data import generate_documents
from hf_distca.linear import LINEAR_BACKENDS, LinearSPConfig
from hf_distca.linear.layers import enable_linear_attention_sp
from hf_distca.linear.ops import chains_of

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accelerate_loop import add_loop_arguments, finish, rank_batches, run_steps  # noqa: E402


def qwen3_next_fields(key_heads: int, head_dim: int, experts: int, expert_size: int) -> dict:
    """Qwen3-Next's gated-DeltaNet heads and experts at a smaller size, in its proportions: twice as many
    value heads as key heads, one head dim for both, 2 routed experts per token and a shared expert as
    wide as a routed one."""
    return dict(
        linear_num_key_heads=key_heads,
        linear_num_value_heads=2 * key_heads,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        num_experts=experts,
        num_experts_per_tok=2,
        moe_intermediate_size=expert_size,
        shared_expert_intermediate_size=expert_size,
    )


# random-init shapes: 3 linear-attention layers per softmax layer (MiniMax-01 uses 7 per 1, Qwen3-Next 3)
SHAPES = {  # per size, what both architectures share: the hidden and MLP widths, layers and query heads
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, head_dim=16
    ),
    "small": dict(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8, head_dim=128
    ),
}
ARCH_FIELDS = {  # per architecture and size: its KV heads, experts and linear-attention heads
    ("minimax", "tiny"): dict(num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=2),
    ("minimax", "small"): dict(num_key_value_heads=4, num_local_experts=1, num_experts_per_tok=1),
    ("qwen3-next", "tiny"): dict(
        num_key_value_heads=2, **qwen3_next_fields(2, 16, experts=2, expert_size=64)
    ),
    ("qwen3-next", "small"): dict(
        num_key_value_heads=2, **qwen3_next_fields(8, 128, experts=4, expert_size=1024)
    ),
}
CONFIGS = {"minimax": MiniMaxConfig, "qwen3-next": Qwen3NextConfig}


def build_model(args, vocab_size: int) -> torch.nn.Module:
    if args.model is not None:
        return AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="distca")
    shape = {**SHAPES[args.size], **ARCH_FIELDS[(args.arch, args.size)]}
    layers = shape["num_hidden_layers"]
    extra = dict(block_size=64) if args.arch == "minimax" else dict(linear_conv_kernel_dim=4)
    config = CONFIGS[args.arch](
        vocab_size=vocab_size,
        layer_types=["full_attention" if i % 4 == 2 else "linear_attention" for i in range(layers)],
        max_position_embeddings=65536,
        use_cache=False,
        **extra,
        **shape,
    )
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(
        config, attn_implementation="distca", experts_implementation="eager"
    )


def main(argv=None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--arch", choices=sorted(CONFIGS), default="minimax", help="architecture of the random init"
    )
    p.add_argument(
        "--model",
        default=None,
        help="local MiniMax or Qwen3-Next checkpoint (default: random init of --size)",
    )
    p.add_argument("--size", choices=("tiny", "small"), default="tiny")
    add_loop_arguments(p, tokens_per_rank=512, num_documents=100)
    p.add_argument("--mean-doc-length", type=int, default=300)
    p.add_argument("--max-doc-length", type=int, default=1000)
    p.add_argument("--scan", choices=("all_scan", "serial", "all_gather"), default="all_scan")
    p.add_argument("--num-blocks", type=int, default=8, help="All-Scan pipeline blocks along the value dim")
    p.add_argument("--backend", choices=LINEAR_BACKENDS, default="auto")
    p.add_argument("--bf16", action="store_true")
    args = p.parse_args(argv)

    # gradient accumulation is train_step's (the loss is already normalized by the whole global batch)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    world = accelerator.num_processes
    vocab = 256
    documents = generate_documents(
        args.num_documents,
        vocab_size=vocab,
        seed=args.seed,
        mean_length=args.mean_doc_length,
        max_length=args.max_doc_length,
    )
    batches = rank_batches(accelerator, documents, args)
    model = build_model(args, vocab)
    if args.bf16:
        model = model.to(torch.bfloat16)
    group = dist.group.WORLD if world > 1 else None
    hf_distca.enable_distca(model, group=group, config=hf_distca.DistCAConfig(shard_tokens=64))
    replaced = enable_linear_attention_sp(
        model,
        group=group,
        config=LinearSPConfig(backend=args.backend, scan=args.scan, num_blocks=args.num_blocks),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate)
    model, optimizer = accelerator.prepare(model, optimizer)
    if accelerator.is_main_process:
        print(f"{replaced} linear-attention layers on the {args.scan} scan, {world} rank(s)", flush=True)

    cut_documents = []  # per micro-batch

    def count_cuts(step_batches: list[dict]) -> None:
        cut_documents.extend(len(chains_of(b["distca_layout"].all_pieces)) for b in step_batches)

    losses = run_steps(accelerator, model, optimizer, batches, args.grad_accum, observe=count_cuts)
    if accelerator.is_main_process:
        print(f"documents cut across ranks: {sum(cut_documents)}", flush=True)
    return finish(accelerator, args.losses_file, losses)


if __name__ == "__main__":
    main()
    sys.exit(0)
