"""What the benchmarks share: the recipe's models and document samples, the timed training step, timing
helpers and result files. Imported by the scripts of this package (``from .common import ...``)."""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import hf_distca
from hf_distca import metrics
from hf_distca.data import DistCABatches, documents_with_lengths
from hf_distca.data.baselines import LAYOUTS
from hf_distca.data.nano import NANO_BATCHES
from hf_distca.data.rebatch import LayoutFn
from hf_distca.planning import imbalance as load_imbalance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB_DOCS = 32000  # token ids of the generated documents (the model's vocabulary stays 128K)


def init_process_group(backend: str, timeout_s: int = 300) -> None:
    """Start the world's process group; for NCCL, on this process's LOCAL_RANK GPU: set as the current device
    first and bound to the group (``device_id``), so that every collective of the run is on that device and a
    later change of the current device is refused (:func:`hf_distca.comm.collective_device`)."""
    kwargs: dict = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(backend, **kwargs)


def init_distributed(cpu: bool, timeout_s: int = 300) -> tuple[int, int, object]:
    """(rank, world, group) of this torchrun process; with WORLD_SIZE > 1 a gloo (``cpu``) or NCCL process
    group over the world is started first."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        init_process_group("gloo" if cpu else "nccl", timeout_s)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank, world, dist.group.WORLD if dist.is_initialized() else None


def init_nccl(script: str) -> tuple[int, int] | None:
    """(rank, world) of this torchrun process on its local CUDA GPU, after starting an NCCL process group
    over the world; None, after saying on stderr that ``script`` needs CUDA GPUs, without one."""
    if select_device(cpu=False) is None:
        print(f"{script} needs CUDA GPUs (run it with torchrun on a GPU machine)", file=sys.stderr)
        return None
    init_process_group("nccl")
    return dist.get_rank(), dist.get_world_size()


def add_model_arguments(p: argparse.ArgumentParser, modes: tuple[str, ...]) -> None:
    """The options of the model-step benchmarks: --model, --layers, --doc-lengths (repeatable), --modes (a
    comma-separated subset of ``modes``)."""
    p.add_argument("--model", default="llama3-8b-shaped", help="a built-in model of the recipe")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument(
        "--doc-lengths", action="append", default=None, help="'mix' or [name=]path.json (repeatable)"
    )
    p.add_argument("--modes", default=",".join(modes), help="comma-separated subset of " + ",".join(modes))


def add_step_arguments(p: argparse.ArgumentParser, *, steps: int = 3) -> None:
    """The options of the timed training steps: --warmup, --steps, --loss-chunk, --seed."""
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--loss-chunk", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)


def load_recipe():
    """recipes/finetune_long_docs.py as a module. The recipes are scripts, not a package: the one already
    imported under its file name (e.g. by a test's preloaded server) is reused, else it is loaded from its
    file and registered under that name."""
    name = "finetune_long_docs"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "recipes", f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before running it, as an import does
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def recipe_model_shape(name: str) -> dict:
    """The config fields of one of the recipe's built-in models."""
    return dict(load_recipe().BUILTIN_MODELS[name])


def long_document_mix(seed: int) -> list[int]:
    """Generated lengths: ~2/3 of the tokens in documents of 16K-128K (log-uniform), the rest short
    (log-normal, median 1.5K)."""
    rng = np.random.default_rng(seed)
    long = np.exp(rng.uniform(np.log(16384), np.log(131072), 300)).astype(np.int64)
    short = np.clip(rng.lognormal(np.log(1500), 1.0, 3000), 32, 16383).astype(np.int64)
    return [int(x) for x in np.concatenate([long, short])]


def load_lengths(spec: str, seed: int) -> tuple[str, list[int]]:
    if spec == "mix":
        return "mix", long_document_mix(seed)
    name, _, path = spec.partition("=")
    if not path:
        name, path = os.path.splitext(os.path.basename(spec))[0], spec
    with open(path) as f:
        return name, [int(x) for x in json.load(f)]


class LossModel(torch.nn.Module):
    """Causal LM whose token-weighted cross-entropy is computed in chunks (logits recomputed in backward)."""

    def __init__(self, lm: torch.nn.Module, chunk: int):
        super().__init__()
        self.lm, self.chunk = lm, chunk

    @staticmethod
    def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = (hidden @ weight.t()).float()  # (c, V)
        return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")

    def forward(self, input_ids, position_ids, shift_labels, distca_layout, num_targets: int):
        hidden = self.lm.model(
            input_ids=input_ids, position_ids=position_ids, distca_layout=distca_layout, use_cache=False
        ).last_hidden_state[0]  # (T, H)
        labels = shift_labels[0]
        weight = self.lm.lm_head.weight
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden.shape[0], self.chunk):
            piece = slice(start, start + self.chunk)
            total = total + checkpoint(
                self._chunk_loss, hidden[piece], weight, labels[piece], use_reentrant=False
            )
        return total / max(num_targets, 1)


def set_mode(lm: torch.nn.Module, mode: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        disable = getattr(lm, "activation_checkpointing_disable", None) or lm.gradient_checkpointing_disable
        disable()
        if mode == "recompute":
            kwargs = {"use_reentrant": False}
            if hasattr(lm, "activation_checkpointing_enable"):
                lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        elif mode == "remat":
            hf_distca.enable_remat_checkpointing(lm)


def max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def barrier(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()


def select_device(cpu: bool) -> tuple[torch.device, torch.dtype] | None:
    """(device, dtype) of this benchmark process: the CPU in float32 for a smoke test, else its local
    CUDA GPU (LOCAL_RANK) in bfloat16; None when there is no CUDA GPU."""
    if cpu:
        return torch.device("cpu"), torch.float32
    if not torch.cuda.is_available():
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank), torch.bfloat16


def build_model(name: str, layers: int, seed: int, device: torch.device, dtype: torch.dtype):
    """The recipe's built-in model ``name`` cut to ``layers`` decoder layers, random init from ``seed``,
    with the ``distca`` attention, no KV cache."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = recipe_model_shape(name)
    shape["num_hidden_layers"] = layers
    shape.setdefault("vocab_size", VOCAB_DOCS)
    config = LlamaConfig(**shape, tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(device):
        lm = AutoModelForCausalLM.from_config(config, attn_implementation="distca", dtype=dtype)
    lm.config.use_cache = False
    return lm


def build_batches(
    sample: list[int],
    tokens_per_rank: int,
    count: int,
    *,
    rank: int,
    world: int,
    seed: int,
    layout: LayoutFn,
    device: torch.device,
    nano_batches: int = 1,
    pad_to_budget: bool = True,
) -> list[dict]:
    """This rank's first ``count`` micro-batches of documents drawn (seeded) from the length ``sample``,
    placed on the ranks by ``layout`` (hf_distca.data.baselines.LAYOUTS), moved to ``device``. With
    ``nano_batches`` > 1 a micro-batch that splits holds its nano-batches' inputs under
    ``hf_distca.data.nano.NANO_BATCHES`` (each with the whole micro-batch's ``num_targets``: their losses
    add up to the micro-batch's), for :func:`hf_distca.forward_nano_batches`. ``pad_to_budget``: as
    :class:`hf_distca.data.DistCABatches`' (False: a micro-batch that runs whole at its fewest tokens per
    rank)."""
    rng = np.random.default_rng(seed)
    wanted = count * tokens_per_rank * world * 3
    lengths: list[int] = []
    while sum(lengths) < wanted:
        lengths += rng.choice(np.asarray(sample), size=256).tolist()
    docs = documents_with_lengths(lengths, vocab_size=VOCAB_DOCS, seed=seed)
    source = DistCABatches(
        docs,
        rank=rank,
        world_size=world,
        tokens_per_rank=tokens_per_rank,
        seed=seed,
        layout=layout,
        nano_batches=nano_batches,
        pad_to_budget=pad_to_budget,
    )

    def model_inputs(batch: dict, targets: int) -> dict:
        return {
            "input_ids": batch["input_ids"].to(device),
            "position_ids": batch["position_ids"].to(device),
            "shift_labels": batch["shift_labels"].to(device),
            "distca_layout": batch["distca_layout"],
            "num_targets": targets,
        }

    batches = []
    for batch in source:
        targets = int(batch["shift_labels"].ne(-100).sum())
        nanos = batch.get(NANO_BATCHES)
        if nanos is None:
            batches.append(model_inputs(batch, targets))
        else:
            batches.append({NANO_BATCHES: tuple(model_inputs(n, targets) for n in nanos)})
        if len(batches) == count:
            break
    return batches


def step_batches(
    sample: list[int],
    tokens_per_rank: int,
    args,
    *,
    rank: int,
    world: int,
    device: torch.device,
    extra: int = 0,
    nano_batches: int = 1,
    pad_to_budget: bool = True,
) -> list[dict]:
    """:func:`build_batches` for a benchmark's timed steps: ``extra + args.warmup + args.steps`` micro-batches,
    seeded by ``args.seed``, laid out by ``args.layout`` (a name in hf_distca.data.baselines.LAYOUTS), with
    ``nano_batches`` per micro-batch and ``pad_to_budget`` as :func:`build_batches`'."""
    count = extra + args.warmup + args.steps
    layout = LAYOUTS[args.layout]
    return build_batches(
        sample, tokens_per_rank, count, rank=rank, world=world, seed=args.seed, layout=layout, device=device,
        nano_batches=nano_batches, pad_to_budget=pad_to_budget,
    )  # fmt: skip


def timed_steps(step, batches, warmup: int, device: torch.device) -> dict:
    """Run ``step(batch)`` on every batch; after ``warmup`` of them: median step time (slowest rank),
    peak memory, forward kernel runs and bytes sent per step (max over ranks), planned imbalance."""
    times, kernels, sent, imbalance = [], [], [], []
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    for i, batch in enumerate(batches):
        if i == warmup and cuda:
            torch.cuda.reset_peak_memory_stats()
        barrier(device)
        metrics.reset()
        start = time.perf_counter()
        step(batch)
        barrier(device)
        elapsed = time.perf_counter() - start
        stats = metrics.snapshot()
        if i >= warmup:
            times.append(elapsed)
            kernels.append(stats.attn_fwd_kernels)
            sent.append(stats.bytes_sent)
            imbalance.append((load_imbalance(stats.flops_before), load_imbalance(stats.flops_after)))
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    step_times = [max_over_ranks([t], device)[0] for t in times]
    peak_max, kernels_max, sent_max = max_over_ranks([peak, float(max(kernels)), float(max(sent))], device)
    return {
        "step_s": statistics.median(step_times),
        "steps": step_times,
        "peak_gib": peak_max,
        "kernels": int(kernels_max),
        "sent_gib": sent_max / 2**30,
        "imbalance": imbalance[0],
    }


def run_mode(model, lm, opt, batches, mode: str, warmup: int, device: torch.device) -> dict:
    """:func:`timed_steps` of forward + backward + optimizer step of ``model`` with checkpointing ``mode``."""
    set_mode(lm, mode)
    lm.train()

    def step(batch: dict) -> None:
        loss = model(**batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timed_steps(step, batches, warmup, device)


def long_share(batches, threshold: int = 16384) -> float:
    """Share of the batches' tokens in documents of >= threshold tokens (padding counts as short)."""
    long_tokens = total = 0
    for batch in batches:
        lengths: dict[int, int] = {}
        for rank_pieces in batch["distca_layout"].all_pieces:
            for doc, start, n in rank_pieces:
                lengths[doc] = max(lengths.get(doc, 0), start + n)
        total += sum(lengths.values())
        long_tokens += sum(n for n in lengths.values() if n >= threshold)
    return long_tokens / max(total, 1)


def write_outputs(results: dict, args, world: int, config, render) -> str:
    """(Re)write the markdown table (``render(results, args, world, config)``) and the JSON of the results
    so far to ``args.out`` / ``args.json``; return the table."""
    text = render(results, args, world, config)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return text


def write_report(text: str, path: str | None) -> None:
    """Write ``text`` to ``path`` (when given; its folder is created) and print it."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {path}")
    print(text)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(
    fn: Callable[[], object],
    iters: int,
    warmup: int,
    *,
    device: torch.device | None = None,
    events: bool = False,
    across_ranks: bool = True,
) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls after ``warmup``: each call after a barrier
    (``across_ranks`` with torch.distributed initialized) and a device sync, timed with CUDA events
    (``events``) or the host clock up to a device sync; with ``across_ranks`` the max over ranks (a step
    waits for the slowest)."""
    device = device or torch.device("cuda")
    for _ in range(warmup):
        fn()
    sync(device)
    ranks = across_ranks and dist.is_initialized()
    times = []
    for _ in range(iters):
        if ranks:
            dist.barrier()
        sync(device)
        if events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            start = time.perf_counter()
            fn()
            sync(device)
            times.append((time.perf_counter() - start) * 1e3)
    median = statistics.median(times)
    if not ranks:
        return median
    t = torch.tensor([median], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
