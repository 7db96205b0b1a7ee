"""Offloaded checkpoints, kept-attention policies and tiled MLP: exact, on 1 process and on 2 gloo ranks.

A tiny Llama (fp32) is trained for one step with checkpointing and every memory option; its loss and every
parameter gradient must equal the run without checkpointing (TOL["grads"]), and, for options that only move
tensors (offloaded inputs, kept outputs in host memory), be bit-identical to the same checkpointing without
them (TOL["exact"]). Counts say the options really acted: tensors offloaded, core-attention forward kernels
(a dropped layer runs its attention again in backward), MLP calls (tiled: once per tile forward and once
in backward, the recompute stops before it). A deliberately wrong unpack (another layer's input) fails.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from test_engine_remat import (
    LAYERS,
    assert_grads_close,
    docs_of,
    grads_of,
    local_batch,
    rank_step_inputs,
    summed_over_ranks,
    tiny_llama,
    with_mode,
)
from tolerances import TOL

import hf_distca
from hf_distca import metrics
from hf_distca.engine.host_arena import ALIGN, PAGE, HostArena
from hf_distca.engine.offload import Offloader, Packed
from hf_distca.kept_attention import choose_kept_attention, per_layer
from hf_distca.offloading import OFFLOAD_ATTR, OffloadOptions, choose_offloaded_inputs, offload_activations
from hf_distca.tiled_mlp import TiledMLP, tile_mlp, untile_mlp

TILE = 16

# name: (checkpointing mode, offload options or None, tile tokens or None)
RUNS = {
    "none": ("none", None, None),
    "remat": ("remat", None, None),
    "inputs": ("remat", OffloadOptions(inputs=True, min_bytes=0), None),
    "host": ("remat", OffloadOptions(inputs=True, kept_attention="host", min_bytes=0), None),
    "drop": ("remat", OffloadOptions(kept_attention="drop", min_bytes=0), None),
    "mixed": ("remat", OffloadOptions(inputs=True, kept_attention=("drop", "host"), min_bytes=0), TILE),
    "tiled": ("remat", None, TILE),
    "recompute_inputs": ("recompute", OffloadOptions(inputs=True, min_bytes=0), TILE),
}
# runs that only move tensors: bit-identical to this run
SAME_BITS = {"inputs": "remat", "host": "remat"}
# forward attention kernels per layer (x layers): a dropped layer's attention runs again in backward
FWD_KERNELS = {"drop": 2 * LAYERS, "mixed": LAYERS + 1, "recompute_inputs": 2 * LAYERS}


def prepared(base, name: str):
    mode, options, tile = RUNS[name]
    model = with_mode(base, mode)
    if tile:
        tile_mlp(model, tile)
    if options is not None:
        offload_activations(model, options)
    return model


def outcome(model, loss) -> dict:
    offload = getattr(model, OFFLOAD_ATTR, None)
    return {
        "loss": float(loss.detach()),
        "grads": grads_of(model),
        "stats": metrics.snapshot(),
        "report": offload.report() if offload else {},
        "arena_live": offload.offloader.arena.live if offload else 0,
    }


def check_runs(runs: dict, label: str) -> None:
    none = runs["none"]
    for name, run in runs.items():
        where = f"{label} {name}"
        assert abs(run["loss"] - none["loss"]) <= TOL["train_loss"][0] * abs(none["loss"]), where
        assert_grads_close(run["grads"], none["grads"], where)
        assert run["arena_live"] == 0, where  # every host view given back after backward
        kernels = FWD_KERNELS.get(name, LAYERS if name != "none" else LAYERS)
        assert run["stats"].attn_fwd_kernels == kernels, (where, run["stats"].attn_fwd_kernels)
    for name, same in SAME_BITS.items():
        rtol, atol = TOL["exact"]
        assert runs[name]["loss"] == runs[same]["loss"], (label, name)
        for key, grad in runs[same]["grads"].items():
            torch.testing.assert_close(runs[name]["grads"][key], grad, rtol=rtol, atol=atol)
    # one layer input per layer offloaded; "host" adds each layer's output and log-sum-exp
    assert runs["inputs"]["report"]["offloaded_tensors"] == LAYERS, label
    assert runs["host"]["report"]["offloaded_tensors"] == 3 * LAYERS, label
    assert runs["host"]["report"]["kept_attention_host_layers"] == LAYERS, label
    assert runs["mixed"]["report"]["offloaded_tensors"] == LAYERS + 2, (
        label
    )  # layer 1 keeps out and lse on host
    assert runs["drop"]["report"]["offloaded_tensors"] == 0, label


# ------------------------------------------------------------------------------------ one process
def test_every_option_exact_local_path():
    base = tiny_llama()
    batch = local_batch()
    runs = {}
    for name in RUNS:
        model = prepared(base, name)
        metrics.reset()
        out = model(**batch, use_cache=False)
        out.loss.backward()
        runs[name] = outcome(model, out.loss)
    check_runs(runs, "local")


def test_wrong_unpack_order_is_caught():
    """Negative control: an offloader that hands layer 1's input back for layer 0 (same shape) gives other
    gradients, and the comparison of this file sees it."""

    class Swapped(Offloader):
        def unpack(self, packed):
            if isinstance(packed, Packed):
                other = [r() for g, refs in self._groups.items() if g != packed.group for r in refs]
                same_shape = [p for p in other if p is not None and p.shape == packed.shape]
                if same_shape:
                    packed = same_shape[0]
            return super().unpack(packed)

    base = tiny_llama()
    batch = local_batch()
    want = prepared(base, "remat")
    want(**batch, use_cache=False).loss.backward()
    model = prepared(base, "inputs")
    offload = getattr(model, OFFLOAD_ATTR)
    offload.offloader.__class__ = Swapped
    model(**batch, use_cache=False).loss.backward()
    with pytest.raises(AssertionError):
        assert_grads_close(grads_of(model), grads_of(want), "swapped")


def test_reentrant_checkpointing_offloads_inputs_and_refuses_kept_placement():
    base = tiny_llama()
    batch = {"input_ids": torch.tensor([docs_of([50], seed=1)[0]])}
    batch["labels"] = batch["input_ids"]
    want = with_mode(base, "none")
    want(**batch, use_cache=False).loss.backward()
    model = copy.deepcopy(base).train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    offload = offload_activations(model, inputs=True, min_bytes=0)
    model(**batch, use_cache=False).loss.backward()
    assert offload.report()["offloaded_tensors"] == LAYERS
    assert_grads_close(grads_of(model), grads_of(want), "reentrant")
    offload_activations(model, inputs=True, kept_attention="host", min_bytes=0)
    with pytest.raises(RuntimeError, match="not rematerialization-aware"):
        model(**batch, use_cache=False)


def test_refusals():
    model = tiny_llama()
    with pytest.raises(ValueError, match="checkpointing is off"):
        offload_activations(model, inputs=True)
    with pytest.raises(ValueError, match="kept_attention must be one of"):
        OffloadOptions(kept_attention="cpu")
    with pytest.raises(ValueError, match="one of .* for each of the model's 2"):
        offload_activations(with_mode(model, "remat"), kept_attention=("gpu",))
    with pytest.raises(ValueError, match="OffloadOptions or its fields"):
        offload_activations(with_mode(model, "remat"), OffloadOptions(), inputs=True)
    with pytest.raises(ValueError, match="host_fraction"):
        OffloadOptions(host_fraction=0.0)
    with pytest.raises(ValueError, match="positive int"):
        tile_mlp(tiny_llama(), 0)

    class Experts(torch.nn.Module):
        experts = ()

    moe = tiny_llama()
    moe.model.layers[0].mlp = Experts()
    with pytest.raises(ValueError, match="mixture of experts"):
        tile_mlp(moe, 8)


# --------------------------------------------------------------------------------- the arena
def test_arena_exact_sizes_reuse_reset_and_growth():
    arena = HostArena(chunk_bytes=PAGE)
    a = arena.take((10, 3), torch.float32)  # 120 bytes
    b = arena.take((7,), torch.float64)  # 56 bytes, at the next multiple of ALIGN
    assert a.shape == (10, 3) and b.dtype == torch.float64
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # one chunk, views into it
    assert b.data_ptr() - a.data_ptr() == -(-120 // ALIGN) * ALIGN
    assert arena.used_bytes == -(-120 // ALIGN) * ALIGN + 56 and arena.capacity_bytes == PAGE
    a.fill_(1.0)
    b.fill_(2.0)
    assert float(a.sum()) == 30.0  # the views do not overlap
    with pytest.raises(RuntimeError, match="live view"):
        arena.reset()
    start = a.data_ptr()
    arena.give_back()
    arena.give_back()  # the last one resets
    assert arena.resets == 1 and arena.used_bytes == 0 and arena.peak_bytes == 184
    assert arena.take((4,), torch.int32).data_ptr() == start  # the same memory again
    big = arena.take((PAGE + 904,), torch.uint8)  # larger than a chunk: a chunk of its own, whole pages
    assert arena.chunk_sizes == [PAGE, 2 * PAGE] and big.numel() == PAGE + 904
    arena.give_back()
    arena.give_back()
    arena.take((PAGE + 1000,), torch.uint8)  # the next step reuses the large chunk: no growth
    assert arena.chunk_sizes == [PAGE, 2 * PAGE]
    arena.give_back()
    assert arena.chunk_sizes == [2 * PAGE] and arena.chunks_released == 1  # the chunk that step left unused
    assert arena.report()["host_arena_gib"] == 2 * PAGE / 2**30
    assert arena.report()["host_arena_peak_held_gib"] == 3 * PAGE / 2**30
    with pytest.raises(RuntimeError, match="given back twice"):
        arena.give_back()
    with pytest.raises(ValueError, match="chunk_bytes"):
        HostArena(chunk_bytes=8)


def _steps(arena: HostArena, steps: list[list[int]]) -> list[tuple[int, int, int]]:
    """Run ``steps`` (per step, the byte sizes of its views) through ``arena``, every view given back at the
    step's end; per step: the bytes it needed, the most the arena held during it, what it held after it."""
    seen = []
    for sizes in steps:
        most = 0
        for n in sizes:
            arena.take((n,), torch.uint8)
            most = max(most, arena.capacity_bytes)
        for _ in sizes:
            arena.give_back()
        seen.append((sum(sizes), most, arena.capacity_bytes))
    return seen


def test_arena_capacity_stays_bounded_when_shapes_vary():
    """Micro-batches whose shapes change every step (each tensor a chunk of its own): what the arena holds
    after a step is at most 1.25 x the largest step's need (chunks rounded up to a size class, and the chunks a
    step did not use freed), during a step at most 2.25 x (last step's chunks, and new ones of this step),
    however many steps; the report says what it holds and held."""
    kib = [1900, 2000, 1950, 2100, 2050]
    steps = [[k * 1024] * 8 for k in kib * 4]  # 8 tensors a step, 20 steps
    arena = HostArena(chunk_bytes=PAGE)
    seen = _steps(arena, steps)
    need = max(n for n, _, _ in seen)  # 8 x 2100 KiB
    for step, (_, most, after) in enumerate(seen):
        assert after <= 1.25 * need and most <= 2.25 * need, (step, seen)
    assert seen[-1][2] == seen[5][2]  # no growth once every size class was seen
    report = arena.report()
    assert report["host_arena_gib"] == arena.capacity_bytes / 2**30
    assert report["host_arena_peak_held_gib"] == max(m for _, m, _ in seen) / 2**30
    assert report["host_arena_chunks"] == 8 and report["host_arena_chunks_released"] == 16
    # shapes drawn at random, a step bigger or smaller than the one before: held after a step is at most
    # the largest step's need twice (a chunk left for a view that did not fit holds less than that view)
    # plus one chunk's rounding
    generator = torch.Generator().manual_seed(0)
    steps = [[int(n) for n in torch.randint(100_000, 3_000_000, (int(c),), generator=generator)]
             for c in torch.randint(1, 12, (40,), generator=generator)]  # fmt: skip
    arena = HostArena(chunk_bytes=1 << 20)
    seen = _steps(arena, steps)
    most_need = max(n for n, _, _ in seen)
    for step, (_, most, after) in enumerate(seen):
        assert after <= 2 * most_need + (1 << 20), (step, after, most_need)
        assert most <= 4 * most_need + (2 << 20), (step, most, most_need)


def test_arena_chunks_are_page_aligned_whole_pages():
    """cudaHostRegister page-locks whole pages: a chunk sharing a page with another chunk (or with other host
    memory) would be registered twice. Every chunk starts at a page boundary and is whole pages."""
    arena = HostArena(chunk_bytes=100)
    for n in (1, 100, 70, PAGE + 1, 3 * PAGE + 5, 10, 2 * PAGE):
        arena.take((n,), torch.uint8)
    assert len(arena.chunk_sizes) >= 4
    spans = []
    for chunk in arena._chunks:
        start = chunk.buffer.data_ptr()
        assert start % PAGE == 0 and chunk.nbytes % PAGE == 0, (start, chunk.nbytes)
        spans.append((start, start + chunk.nbytes))
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), spans


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))],
)
def test_offloader_keeps_no_reference_to_what_it_packed(device):
    """Once packed, a source belongs to its other users only: dropped by them, it is freed (on CUDA before its
    copy to host memory has run; the caching allocator reuses it only after), not at a later pack or group."""
    import gc
    import weakref

    offloader = Offloader(HostArena(1 << 16, pin=device == "cuda"), min_bytes=64)
    group = offloader.begin_group()
    x = torch.randn(100, device=device)
    want = x.detach().cpu().clone()
    gone = weakref.ref(x)
    packed = offloader.pack(x, group)
    del x
    gc.collect()
    assert gone() is None
    torch.testing.assert_close(offloader.unpack(packed).cpu(), want, rtol=0, atol=0)


def test_offloader_prefetches_the_nearest_earlier_offloaded_group():
    """Groups 0, 1 and 3 offloaded a tensor, group 2 none (its layer kept its input on the device): the
    backward of group 3 brings back group 1 (not group 2, which has nothing), and prefetch_before(4) (the
    backward of a group after the last offloaded one) brings back group 3."""
    offloader = Offloader(HostArena(1 << 16), min_bytes=64)
    groups = [offloader.begin_group() for _ in range(5)]
    xs = {g: torch.randn(40 + g) for g in (0, 1, 3)}
    packed = {g: offloader.pack(x, groups[g]) for g, x in xs.items()}
    assert offloader.prefetch_before(4) == 3 and packed[3].device_copy is not None
    assert packed[1].device_copy is None and offloader.groups_prefetched == 1
    torch.testing.assert_close(offloader.unpack(packed[3]), xs[3], rtol=0, atol=0)
    assert packed[1].device_copy is not None and offloader.groups_prefetched == 2  # group 2 skipped
    torch.testing.assert_close(offloader.unpack(packed[1]), xs[1], rtol=0, atol=0)
    assert packed[0].device_copy is not None and offloader.groups_prefetched == 3
    torch.testing.assert_close(offloader.unpack(packed[0]), xs[0], rtol=0, atol=0)
    assert offloader.prefetch_before(0) is None and offloader.groups_prefetched == 3


def test_offloader_round_trip_small_tensors_and_prefetch():
    offloader = Offloader(HostArena(1 << 16), min_bytes=64)
    small, param = torch.randn(3), torch.nn.Parameter(torch.randn(100))
    g0, g1 = offloader.begin_group(), offloader.begin_group()
    x0, x1 = torch.randn(40), torch.randn(50)
    p0, p1 = offloader.pack(x0, g0), offloader.pack(x1, g1)
    assert offloader.pack(small, g0) is small and offloader.pack(param, g0) is param
    assert isinstance(p0, Packed) and offloader.live == 2
    assert p0.device_copy is None
    got1 = offloader.unpack(p1)  # layer 1 first (backward order): layer 0's copy starts now
    assert p0.device_copy is not None and offloader.groups_prefetched == 1
    torch.testing.assert_close(got1, x1, rtol=0, atol=0)
    torch.testing.assert_close(offloader.unpack(p0), x0, rtol=0, atol=0)
    torch.testing.assert_close(offloader.unpack(p0), x0, rtol=0, atol=0)  # again: a retained graph
    del p0, p1
    assert offloader.live == 0 and offloader.arena.live == 0 and offloader.arena.resets == 1


def test_kept_attention_rule():
    gib = 1 << 30
    # 4 layers of 1 GiB: the device holds 2 (half of 4 GiB free), the host 1 (0.8 x 1.5 GiB), one dropped
    policy = choose_kept_attention(4, gib, free_device=4 * gib, free_host=int(1.5 * gib))
    assert policy == ["drop", "host", "gpu", "gpu"]
    assert choose_kept_attention(3, gib, free_device=None, free_host=0) == ["gpu"] * 3
    # inputs kept on the device leave less room there
    assert choose_kept_attention(2, gib, free_device=4 * gib, free_host=0, inputs_on_device=gib) == [
        "drop",
        "gpu",
    ]
    assert per_layer("auto", 3) is None and per_layer("host", 2) == ["host", "host"]


def test_auto_policy_resolves_at_the_first_step_and_reports():
    model = with_mode(tiny_llama(), "remat")
    offload = offload_activations(model, kept_attention="auto", min_bytes=0)
    model(input_ids=torch.tensor([docs_of([40], seed=2)[0]]), use_cache=False).logits.sum().backward()
    report = offload.report()
    assert report["kept_attention"] == ["gpu"] * LAYERS  # no CUDA device: kept where they are
    assert report["kept_attention_gpu_layers"] == LAYERS and "kept_attention_free_host_gib" in report


def test_inputs_split_by_the_host_budget():
    gib = 1 << 30
    # 4 layer inputs of 1 GiB, 0.8 x 2.6 GiB of host: the first 2 go to host memory, the last 2 stay
    assert choose_offloaded_inputs(4, gib, free_host=int(2.6 * gib)) == [True, True, False, False]
    assert choose_offloaded_inputs(3, gib, free_host=None) == [True] * 3  # no CUDA device: every layer
    assert choose_offloaded_inputs(2, gib, free_host=0) == [False, False]
    # a split step equals the step without checkpointing, and moves only layer 0's input
    base = tiny_llama()
    ids = torch.tensor([docs_of([90], seed=8)[0]])
    want = with_mode(base, "none")
    want(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    model = with_mode(base, "remat")
    offload = offload_activations(model, inputs=True, min_bytes=0)
    offload.inputs_policy = [True, False]
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    report = offload.report()
    assert report["offloaded_tensors"] == 1 and report["offload_inputs_host_layers"] == 1, report
    # layer 0's input came back ahead, when layer 1's backward began (layer 1 itself offloaded nothing)
    assert offload.offloader.groups_prefetched == 1
    assert_grads_close(grads_of(model), grads_of(want), "split inputs")


# ------------------------------------------------------------------------------------ tiled MLP
def test_tiled_mlp_runs_once_per_tile_each_way_and_keeps_state_dict_keys():
    base = tiny_llama()
    ids = torch.tensor([docs_of([70], seed=4)[0]])
    want = with_mode(base, "none")
    want(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    for early_stop, calls_per_tile in ((True, 2), (False, 3)):
        model = with_mode(base, "remat")
        assert tile_mlp(model, TILE) == LAYERS
        assert model.state_dict().keys() == base.state_dict().keys()
        calls = []
        for layer in model.model.layers:
            assert isinstance(layer.mlp, TiledMLP)
            layer.mlp.original.register_forward_hook(lambda *args, calls=calls: calls.append(1))
        with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        tiles = -(-70 // TILE)
        # forward and backward once per tile; the recompute stops before the MLP unless early stop is off
        assert len(calls) == calls_per_tile * tiles * LAYERS, (early_stop, len(calls))
        assert_grads_close(grads_of(model), grads_of(want), f"tiled early_stop={early_stop}")
    plain = tiny_llama(seed=5)
    plain.load_state_dict(model.state_dict())  # tiled -> plain
    model.load_state_dict(tiny_llama(seed=6).state_dict())  # plain -> tiled: into the same parameters
    torch.testing.assert_close(
        model.model.layers[0].mlp.original.up_proj.weight,
        tiny_llama(seed=6).model.layers[0].mlp.up_proj.weight,
    )
    assert untile_mlp(model) == LAYERS and not isinstance(model.model.layers[0].mlp, TiledMLP)


# --------------------------------------------------------------------------- 2 gloo ranks, engine
def _ranks_case(rank: int, world: int) -> dict:
    base = tiny_llama(seed=7)
    ids, pos, layout, weights = rank_step_inputs(rank, world)
    config = hf_distca.DistCAConfig(shard_tokens=8, tolerance=0.0)
    runs = {}
    for name in RUNS:
        model = prepared(base, name)
        hf_distca.enable_distca(model, group=dist.group.WORLD, config=config)
        metrics.reset()
        logits = model(input_ids=ids, position_ids=pos, distca_layout=layout.of(rank), use_cache=False).logits
        loss = (logits[0] * weights).sum()
        loss.backward()
        summed = summed_over_ranks(model, loss)
        runs[name] = {**outcome(model, loss), "loss": summed["loss"], "grads": summed["grads"]}
    return runs


def test_every_option_exact_on_two_ranks_with_the_engine():
    per_rank = run_distributed(_ranks_case, 2, timeout=300)
    for rank, runs in enumerate(per_rank):
        check_runs(runs, f"engine/2 rank {rank}")
        assert runs["none"]["stats"].bytes_sent > 0  # the engine really moved rows between the ranks
    assert per_rank[0]["host"]["loss"] == per_rank[1]["host"]["loss"]


# ----------------------------------------------------------------------------------- the recipe's flags
def test_recipe_memory_flags_equal_the_run_without_them(tmp_path):
    """recipes/finetune_long_docs.py on one process: --offload-activations --kept-attention drop,host
    --tiled-mlp 64 with --gradient-checkpointing trains the same losses as without checkpointing, and
    summary.json reports what they did."""
    import json

    from test_recipe import load_recipe

    sample = tmp_path / "lengths.json"
    sample.write_text("[40, 700, 1500, 90, 300]")
    recipe = load_recipe()
    common = ["--doc-lengths", str(sample), "--num-documents", "40", "--max-steps", "2", "--tokens-per-rank",
              "4096", "--optim", "sgd", "--no-save"]  # fmt: skip
    memory = ["--gradient-checkpointing", "--offload-activations", "--kept-attention", "drop,host",
              "--tiled-mlp", "64"]  # fmt: skip
    for attn in ("distca", "local"):
        losses = {}
        for name, extra in (("plain", []), ("memory", memory)):
            out = tmp_path / f"{attn}-{name}"
            summary = recipe.main([*common, "--attn", attn, "--output-dir", str(out), *extra])
            lines = (out / "metrics.jsonl").read_text().splitlines()
            losses[name] = [json.loads(line)["loss"] for line in lines]
        for got, want in zip(losses["memory"], losses["plain"], strict=True):
            assert abs(got - want) <= TOL["train_loss"][0] * abs(want), (attn, losses)
        report = summary["memory"]
        assert report["kept_attention"] == ["drop", "host"] and report["tiled_mlps"] == LAYERS, report
        # micro-batches of ~4K tokens: every layer input (and layer 1's kept output) is over the 1 MiB threshold
        assert report["offloaded_tensors"] > 0, report
