"""Memory options at their edges: the tiled MLP under autocast, the offloaded inputs' split sized for the
whole micro-batch, the host arena pinned where the activations are, a decoder layer called with keyword
hidden states, the owners' sizes of sharded parameters (FSDP2 DTensors on 2 gloo ranks, ZeRO-3's
partitioned parameters), and the tiled norms and MLPs with parameters replaced after tiling (setattr,
load_state_dict(assign=True), FSDP2), on an input without grad, and over Liger's norms."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from distributed import run_distributed
from extras import require
from test_engine_remat import LAYERS, assert_grads_close, docs_of, grads_of, tiny_llama, with_mode
from tolerances import TOL

import hf_distca
from hf_distca import kept_attention
from hf_distca.memory_owners import memory_by_owner
from hf_distca.offloading import OffloadOptions, offload_activations, pins_host_memory
from hf_distca.tiled_mlp import TiledMLP, TiledNorm, tiled_mlp_report, untile_mlp, untile_norms

HIDDEN = 64


# ------------------------------------------------------------------------------ tiled MLP, autocast
def _bf16_autocast_step(mlp, x0: torch.Tensor, grad: torch.Tensor, tile_rows: int | None = None):
    """Output, input gradient and parameter gradients of ``mlp`` (fp32 weights) under CPU bf16 autocast; its
    input is a non-leaf, as in a decoder layer. ``tile_rows``: run it tile by tile instead (each tile its
    own forward and backward, parameter gradients summed in fp32 in tile order)."""
    mlp = copy.deepcopy(mlp)
    x = x0.clone().requires_grad_(True)
    flat, gflat = x.reshape(-1, HIDDEN), grad.reshape(-1, HIDDEN)  # (N, H)
    bounds = (
        [(0, flat.shape[0])]
        if tile_rows is None
        else [(s, s + tile_rows) for s in range(0, len(flat), tile_rows)]
    )
    outs = []
    for start, end in bounds:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = mlp(flat[start:end] * 1.0)  # (rows, H)
        out.backward(gflat[start:end])
        outs.append(out.detach())
    return torch.cat(outs).view_as(grad), x.grad, {n: p.grad for n, p in mlp.named_parameters()}


def test_tiled_mlp_backward_runs_under_the_forwards_autocast():
    """bf16 autocast with fp32 weights: the tiled MLP's backward reruns its tiles in bf16 as its forward
    ran them, so with one tile everything is bit-identical to the untiled MLP (TOL["exact"]); with 5 tiles
    the output and input gradient still are (row by row the same ops), and the parameter gradients are
    bit-identical to the untiled MLP run tile by tile (the same bf16 ops, summed in fp32 in the same order:
    against the whole untiled MLP they differ by bf16 rounding of the per-tile products)."""
    mlp = tiny_llama().model.layers[0].mlp
    x0 = torch.randn(2, 40, HIDDEN, generator=torch.Generator().manual_seed(0))
    grad = torch.randn(2, 40, HIDDEN, generator=torch.Generator().manual_seed(1)).bfloat16()
    rtol, atol = TOL["exact"]
    whole = _bf16_autocast_step(mlp, x0, grad)
    assert whole[0].dtype == torch.bfloat16 and whole[1].dtype == torch.float32
    for tile, param_reference in ((80, whole), (16, _bf16_autocast_step(mlp, x0, grad, tile_rows=16))):
        out, dx, dparams = _bf16_autocast_step(TiledMLP(copy.deepcopy(mlp), tile), x0, grad)
        torch.testing.assert_close(out, whole[0], rtol=rtol, atol=atol)
        torch.testing.assert_close(dx, whole[1], rtol=rtol, atol=atol)
        for name, want in param_reference[2].items():
            torch.testing.assert_close(dparams[name], want, rtol=rtol, atol=atol, msg=f"tile {tile} {name}")


def test_tiled_mlp_report_is_public():
    assert "tiled_mlp_report" in hf_distca.tiled_mlp.__all__
    assert tiled_mlp_report(tiny_llama()) == {
        "tiled_mlps": 0,
        "tiled_mlp_tokens": None,
        "tiled_norms": 0,
        "tiled_norm_tokens": None,
    }


# ------------------------------------------------------------------------------ offloaded inputs' split
def _split_after_first_step(monkeypatch, rows: int, tokens_per_rank: int) -> tuple[list[bool], dict]:
    """A CUDA-like budget on the CPU: 10 GiB free on the device, and host memory for 1.5 layer inputs of
    ``tokens_per_rank`` rows (0.8 of it: 1 layer). The callback installs inputs=True offload, then one
    micro-batch of ``rows`` rows runs."""
    layer_bytes = tokens_per_rank * HIDDEN * 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(kept_attention, "free_device_bytes", lambda device=None: 10 << 30)
    monkeypatch.setattr(kept_attention, "free_host_bytes", lambda: int(1.5 * layer_bytes / 0.8))
    model = with_mode(tiny_llama(), "remat")
    callback = hf_distca.DistCACallback(tokens_per_rank, offload=OffloadOptions(inputs=True, min_bytes=0))
    args = types.SimpleNamespace(device=torch.device("cpu"), bf16=False, fp16=False)
    callback._start_offload(args, model)
    ids = torch.tensor([docs_of([rows], seed=3)[0]])
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    offload = callback._offload
    return list(offload.inputs_policy), offload.report()


@pytest.mark.parametrize("rows", [40, 512])
def test_inputs_split_sized_for_tokens_per_rank_not_the_first_micro_batch(monkeypatch, rows):
    """A short first micro-batch (or one nano-batch of layer ping-pong) gives the split of a full one:
    the callback sizes it for tokens_per_rank rows before the first step."""
    split, report = _split_after_first_step(monkeypatch, rows, tokens_per_rank=512)
    assert split == [True] + [False] * (LAYERS - 1), split
    assert report["offloaded_tensors"] == 1 and report["offload_inputs_layer_gib"] == 512 * HIDDEN * 4 / 2**30


# ------------------------------------------------------------------------------ pinning
def test_host_arena_pinned_where_the_activations_are():
    """Pinning follows the activations' device, not the parameters' (FSDP2's CPU offload keeps those in
    host memory while activations are on the GPU); on the CPU the arena stays plain host memory."""
    assert pins_host_memory(torch.device("cuda", 0)) and pins_host_memory(torch.device("cuda"))
    assert not pins_host_memory(torch.device("cpu"))
    model = with_mode(tiny_llama(), "remat")
    offload = offload_activations(model, inputs=True, min_bytes=0)
    ids = torch.tensor([docs_of([30], seed=5)[0]])
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert offload.report()["offloaded_tensors"] == LAYERS and not offload.offloader.arena.pin


# ------------------------------------------------------------------------------ keyword hidden states
def _layer_step(model, ids: torch.Tensor, keyword: bool):
    """Run the decoder layers one by one (hidden_states positional or keyword), then the norm and a loss."""
    inner = model.model
    hidden = inner.embed_tokens(ids)  # (1, T, H)
    positions = torch.arange(ids.shape[1])[None]  # (1, T)
    rotary = inner.rotary_emb(hidden, positions)
    for layer in inner.layers:
        kwargs = {"attention_mask": None, "position_ids": positions, "position_embeddings": rotary}
        hidden = layer(hidden_states=hidden, **kwargs) if keyword else layer(hidden, **kwargs)
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
    inner.norm(hidden).pow(2).mean().backward()


def test_layer_called_with_keyword_hidden_states():
    """Transformers' checkpoint keeps keyword arguments in a closure, out of reach of the offload: a layer
    whose input goes to host memory refuses keyword hidden states (on its first call too, which resolves the
    policy from them); kept attention placement, inside the checkpoint, works for them as for positional ones."""
    base = tiny_llama()
    ids = torch.tensor([docs_of([60], seed=6)[0]])
    model = with_mode(base, "remat")
    offload_activations(model, inputs=True, min_bytes=0)
    with pytest.raises(ValueError, match=r"inputs=True.*--offload-activations.*hidden_states as a keyword"):
        _layer_step(model, ids, keyword=True)
    runs = {}
    for keyword in (False, True):
        model = with_mode(base, "remat")
        offload = offload_activations(model, kept_attention="host", min_bytes=0)
        _layer_step(model, ids, keyword)
        runs[keyword] = (grads_of(model), offload.report())
    # each layer's attention output and log-sum-exp in host memory, either way
    assert runs[True][1]["offloaded_tensors"] == 2 * LAYERS == runs[False][1]["offloaded_tensors"], runs[
        True
    ][1]
    rtol, atol = TOL["exact"]
    for name, grad in runs[False][0].items():
        torch.testing.assert_close(runs[True][0][name], grad, rtol=rtol, atol=atol)


def test_layer_called_without_hidden_states_is_refused():
    model = with_mode(tiny_llama(), "remat")
    offload_activations(model, inputs=True, min_bytes=0)
    with pytest.raises(TypeError, match="without hidden_states"):
        model.model.layers[0](attention_mask=None)


# ------------------------------------------------------------------------------ sharded owners
def _owner_sizes(model) -> tuple[float, float]:
    owners = memory_by_owner(model, tokens=8, compute_dtype=torch.float32, remat=False)
    return owners["weights_gib"], owners["gradients_gib"]


def test_zero3_partitioned_parameters_counted_by_their_shard():
    """ZeRO-3 replaces a partitioned parameter's data by an empty tensor (numel 0) and keeps this rank's
    shard in ``ds_tensor``: that shard is what the rank holds."""
    model = tiny_llama()
    full_weights, full_grads = _owner_sizes(model)
    for p in model.parameters():
        shard = p.data.reshape(-1)[: (p.numel() + 1) // 2].clone()  # rank 0 of 2
        p.data = torch.empty(0)
        p.ds_tensor = shard
    weights, grads = _owner_sizes(model)
    shards = sum(p.ds_tensor.numel() for p in model.parameters()) * 4 / 2**30  # fp32
    assert weights == grads == shards and shards < 0.51 * full_weights, (weights, full_weights)


def _fsdp2_case(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    model = tiny_llama()
    full = _owner_sizes(model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return {"full": full, "sharded": _owner_sizes(model)}


def test_fsdp2_dtensor_parameters_counted_by_their_local_shard():
    per_rank = run_distributed(_fsdp2_case, 2, timeout=300)
    full_weights, full_grads = per_rank[0]["full"]
    weights = [r["sharded"][0] for r in per_rank]
    grads = [r["sharded"][1] for r in per_rank]
    # the ranks' shards add up to the whole model (dim-0 shards, the last one possibly shorter)
    rtol = TOL["fp64_reordered"][0]  # sums of the same byte counts / 2**30 in another order
    assert sum(weights) == pytest.approx(full_weights, rel=rtol) and all(w < full_weights for w in weights)
    assert sum(grads) == pytest.approx(full_grads, rel=rtol)


# ------------------------------------------------------------------------------------ tiled norms
def _fp32_hidden_copies(model, ids) -> tuple[int, float]:
    """Rows of the largest float32 tensor of the hidden size made in one training step of ``model`` (a bf16
    model: float32 there is a norm's upcast), and the loss."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        rows = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.shape[-1:] == (HIDDEN,):
                    self.rows = max(self.rows, t.numel() // HIDDEN)
            return out

    with Largest() as mode:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
    return mode.rows, loss.item()


def test_tiled_norms_are_exact_keep_state_dict_keys_and_upcast_one_tile_at_a_time():
    """tile_norms swaps both norms of every decoder layer and the final norm: the same state_dict keys, the
    loss and every gradient of a checkpointed step equal the step without checkpointing or tiling (fp32,
    TOL["grads"]); on a bf16 model the float32 copies Llama's RMSNorm makes of the hidden states hold one
    tile's rows at a time, not the sequence's."""
    tile, length = 16, 90
    base = tiny_llama()
    ids = torch.tensor([docs_of([length], seed=8)[0]])
    want = with_mode(base, "none")
    want(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    model = with_mode(base, "remat")
    assert hf_distca.tile_norms(model, tile) == 2 * LAYERS + 1
    assert model.state_dict().keys() == base.state_dict().keys()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    rtol, atol = TOL["grads"]
    for name, g in grads_of(want).items():
        torch.testing.assert_close(grads_of(model)[name], g, rtol=rtol, atol=atol, msg=name)
    rows = {}
    for tiled in (False, True):
        model = with_mode(base.to(torch.bfloat16), "remat")
        if tiled:
            hf_distca.tile_norms(model, tile)
        rows[tiled], _ = _fp32_hidden_copies(model, ids)
    assert rows[False] == length and 0 < rows[True] <= tile, rows  # equal tiles of <= tile rows
    assert hf_distca.tiled_mlp.untile_norms(model) == 2 * LAYERS + 1
    assert tiled_mlp_report(model)["tiled_norms"] == 0


def test_tiled_parameter_gradients_are_summed_in_float32():
    """bf16 parameters, 24 tiles: each parameter's gradient is the float32 sum of its per-tile gradients in
    tile order, rounded to bf16 once (bit-identical); summing in bf16 instead rounds at every tile and
    differs (the check has the power to fail)."""
    mlp = copy.deepcopy(tiny_llama().model.layers[0].mlp).to(torch.bfloat16)
    x = torch.randn(2, 96, HIDDEN, generator=torch.Generator().manual_seed(2)).bfloat16()
    grad = torch.randn(2, 96, HIDDEN, generator=torch.Generator().manual_seed(3)).bfloat16()
    tile = 8
    tiled = TiledMLP(copy.deepcopy(mlp), tile)
    xin = x.clone().requires_grad_(True)
    tiled(xin * 1.0).backward(grad)
    flat, gflat = x.reshape(-1, HIDDEN), grad.reshape(-1, HIDDEN)  # (N, H)
    names = [n for n, _ in mlp.named_parameters()]
    fp32 = {n: None for n in names}
    bf16 = dict(fp32)
    for start in range(0, flat.shape[0], tile):
        part = flat[start : start + tile].clone().requires_grad_(True)
        grads = torch.autograd.grad(mlp(part * 1.0), list(mlp.parameters()), gflat[start : start + tile])
        for n, g in zip(names, grads, strict=True):
            fp32[n] = g.float() if fp32[n] is None else fp32[n] + g.float()
            bf16[n] = g if bf16[n] is None else bf16[n] + g
    differs = False
    for n, p in tiled.named_parameters():
        assert p.grad.dtype == torch.bfloat16
        assert torch.equal(p.grad, fp32[n].to(torch.bfloat16)), n
        differs |= not torch.equal(p.grad, bf16[n])
    assert differs, "summing in bf16 gave the same bits: the check cannot tell the two apart"


def _tiled(model, tile: int = 16):
    """``model`` with every norm and MLP tiled."""
    assert hf_distca.tile_norms(model, tile) == 2 * LAYERS + 1 and hf_distca.tile_mlp(model, tile) == LAYERS
    return model


def _step(model, ids: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach()


def _assert_step_equal(model, want, ids: torch.Tensor, label: str) -> None:
    """The loss and every gradient of a step of ``model`` equal those of ``want`` (fp32: the loss to
    TOL["logits"], gradients to TOL["grads"])."""
    rtol, atol = TOL["logits"]
    torch.testing.assert_close(_step(model, ids), _step(want, ids), rtol=rtol, atol=atol, msg=label)
    assert_grads_close(grads_of(model), grads_of(want), label)


@pytest.mark.parametrize("mode", ["none", "remat"])
def test_tiled_modules_compute_with_the_parameters_set_after_tiling(mode):
    """Parameters and children set on the tiled model after the swap (setattr on a TiledNorm and a
    TiledMLP, ``load_state_dict(assign=True)``) are the ones its tiles compute with: the loss and every
    gradient equal the untiled model's with the same new weights, the gradients land on the parameters the
    model now holds (the replaced ones get none), and untiling gives back a module computing with them."""
    ids = torch.tensor([docs_of([70], seed=9)[0]])
    model, want = _tiled(with_mode(tiny_llama(), mode)), with_mode(tiny_llama(), "none")
    g = torch.Generator().manual_seed(4)
    replaced = []
    for m in (model, want):
        layer = m.model.layers[0]
        replaced.append(layer.input_layernorm.weight)
        layer.input_layernorm.weight = torch.nn.Parameter(1 + torch.rand(HIDDEN, generator=g))
        m.model.norm.weight = torch.nn.Parameter(1 + torch.rand(HIDDEN, generator=g))
        up = torch.nn.Linear(HIDDEN, layer.mlp.up_proj.out_features, bias=False)
        torch.nn.init.normal_(up.weight, std=0.2, generator=g)
        layer.mlp.up_proj = up
    for a, b in zip(model.parameters(), want.parameters(), strict=True):  # the same new values
        with torch.no_grad():
            b.copy_(a)
    layer = model.model.layers[0]
    assert isinstance(layer.input_layernorm, TiledNorm) and isinstance(layer.mlp, TiledMLP)
    assert layer.input_layernorm.original.weight is layer.input_layernorm.weight
    assert layer.mlp.original.up_proj is layer.mlp.up_proj
    _assert_step_equal(model, want, ids, f"{mode} setattr")
    assert replaced[0].grad is None and layer.input_layernorm.weight.grad is not None

    source = tiny_llama(seed=6)
    state = {k: v.clone() for k, v in source.state_dict().items()}
    model.zero_grad(set_to_none=True)
    before = dict(model.named_parameters())
    model.load_state_dict(state, assign=True)
    assert model.state_dict().keys() == source.state_dict().keys()
    _assert_step_equal(model, with_mode(source, "none"), ids, f"{mode} load_state_dict(assign=True)")
    for name, p in model.named_parameters():
        assert p.data_ptr() == state[name].data_ptr() and p.grad is not None, name  # the assigned tensor
        assert p is not before[name] and before[name].grad is None, name  # the replaced one got nothing
    assert model.model.norm.original.weight.data_ptr() == state["model.norm.weight"].data_ptr()

    assert untile_norms(model) == 2 * LAYERS + 1 and untile_mlp(model) == LAYERS
    _assert_step_equal(model, with_mode(source, "none"), ids, f"{mode} untiled")


@pytest.mark.parametrize("mode", ["none", "remat"])
def test_tiled_modules_train_their_weights_on_an_input_without_grad(mode):
    """Frozen input embeddings: layer 0's first norm gets an input that does not require grad. Every
    trainable gradient of the tiled model equals the untiled model's (fp32, TOL["grads"]) and the embeddings
    get none; a TiledMLP on an input without grad trains its weights as the untiled MLP does."""
    ids = torch.tensor([docs_of([70], seed=10)[0]])
    models = {}
    for tiled in (False, True):
        model = with_mode(tiny_llama(), mode if tiled else "none")
        model.get_input_embeddings().requires_grad_(False)
        models[tiled] = _tiled(model) if tiled else model
    _assert_step_equal(models[True], models[False], ids, f"{mode} frozen embeddings")
    assert models[True].get_input_embeddings().weight.grad is None

    mlp = tiny_llama().model.layers[0].mlp
    x = torch.randn(2, 40, HIDDEN, generator=torch.Generator().manual_seed(5))
    grad = torch.randn(2, 40, HIDDEN, generator=torch.Generator().manual_seed(6))
    tiled = TiledMLP(copy.deepcopy(mlp), 16)
    tiled(x).backward(grad)
    mlp(x).backward(grad)
    rtol, atol = TOL["grads"]
    for (name, got), want in zip(tiled.named_parameters(), mlp.parameters(), strict=True):
        torch.testing.assert_close(
            got.grad, want.grad, rtol=rtol, atol=atol * float(want.grad.abs().max()), msg=name
        )


def _fsdp2_tiled_case(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    ids = torch.tensor([docs_of([70], seed=9)[0]])
    model = _tiled(tiny_llama())
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    _step(model, ids)
    return {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}


def test_fsdp2_trains_tiled_norms_and_mlps():
    """fully_shard swaps the parameters of the tiled modules for DTensors after tiling: the tiles compute
    with them, so every parameter (the norms' included) gets the untiled model's gradient (fp32,
    TOL["grads"]) on both gloo ranks."""
    ids = torch.tensor([docs_of([70], seed=9)[0]])
    want = tiny_llama()
    _step(want, ids)
    for rank, grads in enumerate(run_distributed(_fsdp2_tiled_case, 2, timeout=300)):
        assert_grads_close(grads, grads_of(want), f"FSDP2 rank {rank}")


def test_tile_norms_recognises_liger_norms_and_leaves_fused_ones():
    """Liger's norms that replace Transformers' (``LigerRMSNormForGemma`` subclasses ``LigerRMSNorm``) are
    tiled; a fused residual-add norm (two inputs) is not position-wise over one input and is left alone."""
    rms_norm = require("liger_kernel.transformers.rms_norm", "liger")
    fused = require("liger_kernel.transformers.fused_add_rms_norm", "liger")
    model = tiny_llama()
    for layer in model.model.layers:
        layer.input_layernorm = rms_norm.LigerRMSNormForGemma(HIDDEN)
        layer.post_attention_layernorm = fused.LigerFusedAddRMSNorm(HIDDEN)
    model.model.norm = rms_norm.LigerRMSNorm(HIDDEN)
    assert hf_distca.tile_norms(model, 16) == LAYERS + 1
    assert all(isinstance(layer.input_layernorm, TiledNorm) for layer in model.model.layers)
    assert not any(isinstance(layer.post_attention_layernorm, TiledNorm) for layer in model.model.layers)
    assert isinstance(model.model.norm, TiledNorm)


def test_auto_kept_attention_reserves_the_gradients_backward_will_allocate():
    """kept_attention="auto" at the first step: the free device memory it shares out excludes the gradients
    that the first backward allocates (parameters off the CPU without a gradient yet): with room for every
    kept output only before that reserve, they go to host memory; once the gradients exist, to the device."""
    tokens = 64
    policies = {}
    for grads_exist in (False, True):
        model = with_mode(tiny_llama(), "remat").to("meta")  # off the CPU, no memory
        if grads_exist:
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        offload = offload_activations(model, kept_attention="auto", working_set_layers=0)
        layer_kept = kept_attention.kept_attention_bytes(tokens, 4, 16, torch.float32)
        inputs = LAYERS * tokens * HIDDEN * 4  # float32 inputs, all on the device (inputs=False)
        free_device = 2 * (inputs + LAYERS * layer_kept)  # device_fraction 0.5: room for every kept output
        policies[grads_exist] = offload.resolve(
            tokens, torch.float32, free_device=free_device, free_host=1 << 40
        )
        grads = sum(p.numel() * 4 for p in model.parameters())
        assert grads > free_device  # the reserve takes it all
        reserved = offload.report()["kept_attention_gradients_reserved_gib"]
        assert reserved == (0 if grads_exist else grads / 2**30)
    assert policies == {False: ["host"] * LAYERS, True: ["gpu"] * LAYERS}, policies


def test_auto_kept_attention_reserves_the_working_set():
    """kept_attention="auto" reserves working_set_layers x one layer's input for backward's working set
    before the kept outputs get their share: room for every output without the reserve, none with it."""
    tokens = 64
    layer_input = tokens * HIDDEN * 4
    layer_kept = kept_attention.kept_attention_bytes(tokens, 4, 16, torch.float32)
    policies = {}
    for working_set in (0, 8):
        model = with_mode(tiny_llama(), "remat").to("meta")
        for p in model.parameters():
            p.grad = torch.zeros_like(p)  # no gradients to come: only the working set is reserved
        offload = offload_activations(model, kept_attention="auto", working_set_layers=working_set)
        free_device = 2 * (LAYERS * layer_input + LAYERS * layer_kept)  # device_fraction 0.5: room for all
        policies[working_set] = offload.resolve(
            tokens, torch.float32, free_device=free_device, free_host=1 << 40
        )
        assert (
            offload.report()["kept_attention_working_set_reserved_gib"] == working_set * layer_input / 2**30
        )
    assert policies == {0: ["gpu"] * LAYERS, 8: ["host"] * LAYERS}, policies
    with pytest.raises(ValueError, match="working_set_layers must be a number >= 0, got -1"):
        OffloadOptions(working_set_layers=-1)
