"""CUDA kernel backends (torch_varlen, cudnn and flash_attn when installed) against the reference kernel.

bf16, GQA 32/8 heads x 128: whole documents, CA-task suffix shards (cu_seqlens_q != cu_seqlens_k), the
two mixed in one call, empty, 1-token and KV-only (0-query) sequences, lengths up to 8K. Forward output
and log-sum-exp, and the explicit backward (dq, dk, dv), each against the float32 reference on the same
bf16 values; sliding windows, attention sinks, logit softcapping (computed or refused). Skipped without CUDA.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from tolerances import TOL

from hf_distca import kernels
from hf_distca.engine import local_attention
from hf_distca.engine.remat import TRACED_REMAT_MIN_TORCH
from hf_distca.kernels import (
    ForwardTensors,
    UnsupportedFeatureError,
    attention_backward,
    attention_forward,
    available_backends,
    cudnn_backend,
    cudnn_calls,
    cudnn_frontend,
    flash,
    reference_varlen_attention,
    sinks_backward,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


HQ, HKV, D = 32, 8, 128
SHAPES = {
    # (q_lens, k_lens)
    "whole_docs": ([1, 129, 1000, 2048, 8192], [1, 129, 1000, 2048, 8192]),
    "suffix_tasks": ([128, 1, 1000, 2048, 4096], [1024, 1, 3000, 2048, 8192]),
    # prefix and suffix sequences in one call, with empty (0/0) and KV-only (0 queries) sequences
    "mixed_empty": ([0, 700, 0, 1, 300, 0, 2048], [0, 700, 513, 5, 900, 0, 2048]),
}


def _usable() -> list[str]:
    if not torch.cuda.is_available():
        return []
    return [b for b in available_backends(torch.device("cuda"), torch.bfloat16) if b != "reference"]


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _inputs(q_lens, k_lens, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sum(q_lens), HQ, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(sum(k_lens), HKV, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(sum(k_lens), HKV, D, device="cuda", generator=g).bfloat16()
    dout = torch.randn(q.shape, device="cuda", generator=g).bfloat16()
    return q, k, v, dout


def _reference(q, k, v, dout, args, window=None, **scores):
    """float32 math on the same bf16 values, gradients by autograd; nothing rounded to bf16. ``scores``:
    softcap / sinks (float32 leaves whose .grad autograd fills)."""
    qq, kk, vv = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    out, lse = reference_varlen_attention(qq, kk, vv, *args, return_lse=True, window=window, **scores)
    out.backward(dout.float())
    return out.detach(), lse, qq.grad, kk.grad, vv.grad


def _assert_close_to_reference(got, want, kv_only_rows):
    rtol, atol = TOL["gpu_out"]
    torch.testing.assert_close(got[0].float(), want[0], rtol=rtol, atol=atol, msg=lambda m: f"out: {m}")
    rtol, atol = TOL["gpu_lse"]
    torch.testing.assert_close(got[1].float(), want[1], rtol=rtol, atol=atol, msg=lambda m: f"lse: {m}")
    rtol, scale_tol = TOL["gpu_grad"]
    for name, a, b in zip(("dq", "dk", "dv"), got[2:], want[2:]):
        assert b.abs().max() > 0
        atol = scale_tol * float(b.abs().max())
        torch.testing.assert_close(a.float(), b, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
    for name, a in zip(("dk", "dv"), got[3:]):
        assert torch.all(a[kv_only_rows] == 0), f"{name} of keys no query sees must be exactly zero"


def _kv_only_rows(q_lens, k_lens):
    rows = torch.zeros(sum(k_lens), dtype=torch.bool, device="cuda")
    start = 0
    for lq, lk in zip(q_lens, k_lens):
        rows[start : start + lk] = lq == 0
        start += lk
    return rows


# cudnn runs in both suffix strategies (see hf_distca/kernels/cudnn_backend.py)
VARIANTS = ["cudnn:split", "cudnn:bottom_right", "torch_varlen", "flash_attn"]


def _select(variant: str) -> dict:
    """attention_forward/attention_backward's keyword arguments that run ``variant``."""
    backend, _, strategy = variant.partition(":")
    strategy, _, rows = strategy.partition(":")
    if backend not in _usable():
        pytest.skip(f"backend {backend} is not available here")
    if strategy:
        options = cudnn_backend.CudnnOptions(suffix_strategy=strategy, backward_rows=int(rows or 65536))
        return {"backend": backend, "cudnn_options": options}
    return {"backend": backend}


@pytest.mark.parametrize("case", sorted(SHAPES))
@pytest.mark.parametrize("variant", [*VARIANTS, "cudnn:split:1000"])  # backward launches of <= 1000 rows
def test_cuda_backend_forward_backward_match_reference(variant, case):
    run = _select(variant)
    q_lens, k_lens = SHAPES[case]
    q, k, v, dout = _inputs(q_lens, k_lens)
    args = (_cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens))
    out, lse = attention_forward(q, k, v, *args, **run)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == q.shape[:2]
    grads = attention_backward(dout, q, k, v, out, lse, *args, **run)
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3
    _assert_close_to_reference(
        (out, lse, *grads), _reference(q, k, v, dout, args), _kv_only_rows(q_lens, k_lens)
    )


# sliding windows: CA-tasks of a window-1024 layer (queries [a, b) over keys [max(0, a - 1023), b)): shards
# starting at 0, inside the window and past it, whole documents longer than the window, a KV-only sequence
WINDOW_SHAPES = {
    "tasks_1024": ([1000, 512, 2048, 1, 0], [1000, 1535, 3071, 2, 700], 1024),
    "docs_256": ([4096, 129, 1], [4096, 129, 1], 256),
}


@pytest.mark.parametrize("case", sorted(WINDOW_SHAPES))
@pytest.mark.parametrize("variant", VARIANTS)
def test_cuda_backend_sliding_window_matches_reference(variant, case):
    run = _select(variant)
    q_lens, k_lens, window = WINDOW_SHAPES[case]
    q, k, v, dout = _inputs(q_lens, k_lens, seed=2)
    args = (_cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens))
    out, lse = attention_forward(q, k, v, *args, window=window, **run)
    grads = attention_backward(dout, q, k, v, out, lse, *args, window=window, **run)
    want = _reference(q, k, v, dout, args, window)
    _assert_close_to_reference((out, lse, *grads), want, _kv_only_rows(q_lens, k_lens))
    causal = _reference(q, k, v, dout, args)
    assert (causal[0] - want[0]).abs().max() > 0.05  # the window cuts: the case tests something


@pytest.mark.parametrize("variant", VARIANTS)
def test_cuda_backend_sinks_match_reference(variant):
    """Attention sinks (gpt-oss) on every backend: applied to its output and log-sum-exp; its unchanged
    backward fed that lse gives dq, dk, dv; sinks_backward the sinks' gradient (float32 math, bf16 rows)."""
    run = _select(variant)
    q_lens, k_lens, window = WINDOW_SHAPES["tasks_1024"]
    q, k, v, dout = _inputs(q_lens, k_lens, seed=3)
    args = (_cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens))
    sinks = torch.linspace(-2.0, 10.0, HQ, device="cuda")  # p_sink from ~0 to ~1 (row lse ~ 7-8 here)
    out, lse = attention_forward(q, k, v, *args, window=window, sinks=sinks, **run)
    grads = attention_backward(dout, q, k, v, out, lse, *args, window=window, **run)
    leaf = sinks.clone().requires_grad_(True)
    want = _reference(q, k, v, dout, args, window, sinks=leaf)
    _assert_close_to_reference((out, lse, *grads), want, _kv_only_rows(q_lens, k_lens))
    rtol, scale_tol = TOL["gpu_grad"]
    dsinks = sinks_backward(dout, out, lse, sinks)
    torch.testing.assert_close(dsinks, leaf.grad, rtol=rtol, atol=scale_tol * float(leaf.grad.abs().max()))


@pytest.mark.parametrize("variant", VARIANTS)
def test_cuda_backend_softcap_computed_or_refused(variant):
    """Logit softcapping (Gemma 2): flash_attn (>= 2.6) computes it (checked against the reference); cudnn
    and torch_varlen refuse it, naming flash_attn and reference."""
    run = _select(variant)
    q_lens, k_lens, window = WINDOW_SHAPES["tasks_1024"]
    q, k, v, dout = _inputs(q_lens, k_lens, seed=4)
    args = (_cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens))
    if run["backend"] != "flash_attn" or not flash.supports_softcap():
        with pytest.raises(UnsupportedFeatureError, match="'flash_attn'.*'reference'"):
            attention_forward(q, k, v, *args, window=window, softcap=5.0, **run)
        return
    out, lse = attention_forward(q, k, v, *args, window=window, softcap=5.0, **run)
    grads = attention_backward(dout, q, k, v, out, lse, *args, window=window, softcap=5.0, **run)
    want = _reference(q, k, v, dout, args, window, softcap=5.0)
    _assert_close_to_reference((out, lse, *grads), want, _kv_only_rows(q_lens, k_lens))


@pytest.mark.parametrize("variant", VARIANTS)
def test_cuda_backend_autograd_function(variant, monkeypatch):
    """local_attention (the differentiable operator on one process) gives the same gradients through
    autograd."""
    run = _select(variant)
    backend, options = run["backend"], run.get("cudnn_options")
    if options is not None:  # local_attention takes no cudnn options: bind them into the registry entry
        entry = kernels._BACKENDS["cudnn"]
        forward = functools.partial(entry.forward, options=options)
        backward = functools.partial(entry.backward, options=options)
        monkeypatch.setitem(
            kernels._BACKENDS, "cudnn", dataclasses.replace(entry, forward=forward, backward=backward)
        )
    q_lens, k_lens = SHAPES["mixed_empty"]
    q, k, v, dout = _inputs(q_lens, k_lens, seed=1)
    args = (_cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens))
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = local_attention(qq, kk, vv, *args, backend=backend)
    out.backward(dout)
    _, lse = attention_forward(q, k, v, *args, backend=backend)  # the registry entry holds the options
    got = (out.detach(), lse, qq.grad, kk.grad, vv.grad)
    _assert_close_to_reference(got, _reference(q, k, v, dout, args), _kv_only_rows(q_lens, k_lens))


def test_cudnn_launch_writes_only_its_own_rows():
    """The cudnn backend lets several launches share output buffers: a launch must leave every row
    outside its sequences untouched (checked on buffers poisoned with NaN). Forward launches may address
    sequences with gaps between them; backward launches are always packed from row 0."""
    if "cudnn" not in _usable():
        pytest.skip("backend cudnn is not available here")
    q_lens, k_lens = [300, 200, 129], [300, 700, 129]
    q, k, v, dout = _inputs(q_lens, k_lens, seed=2)
    scale = D**-0.5
    # forward over sequences 0 and 2 only (rows q 0-299 and 500-628, k 0-299 and 1000-1128)
    call = cudnn_calls.KernelCall(
        cudnn_calls.TOP_LEFT, (0, 500), (0, 1000), (300, 129), (300, 129), (0, 500), False
    )
    mine_q = torch.zeros(q.shape[0], dtype=torch.bool, device="cuda")
    mine_q[0:300] = mine_q[500:629] = True
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device="cuda")
    cudnn_frontend.launch_forward(call, q, k, v, out, lse, scale)
    assert not out[mine_q].isnan().any() and not lse[mine_q].isnan().any()
    assert out[~mine_q].isnan().all() and lse[~mine_q].isnan().all()
    # backward over two packed sequences (q rows 0-299 and 300-428, k rows 0-299 and 300-428)
    packed = cudnn_calls.KernelCall(
        cudnn_calls.TOP_LEFT, (0, 300), (0, 300), (300, 129), (300, 129), (0, 300), False
    )
    out, lse = torch.zeros_like(q), torch.zeros(q.shape[:2], device="cuda")
    cudnn_frontend.launch_forward(packed, q, k, v, out, lse, scale)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    cudnn_frontend.launch_backward(packed, dout, ForwardTensors(q, k, v, out, lse), (dq, dk, dv), scale)
    assert not dq[:429].isnan().any() and dq[429:].isnan().all()
    for grad in (dk, dv):
        assert not grad[:429].isnan().any() and grad[429:].isnan().all()


def test_cudnn_plans_are_reused_across_nearby_shapes():
    """Batch sizes and lengths within one bucket reuse the plans built for the first call."""
    _select("cudnn:split")
    # same grouping (two whole documents, one suffix task), every shape in the same bucket
    runs = [([1000, 3000, 700], [1000, 3000, 900]), ([1010, 2900, 650], [1010, 2900, 860])]
    builds = []
    for q_lens, k_lens in runs:
        q, k, v, dout = _inputs(q_lens, k_lens, seed=3)
        args = (_cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens))
        out, lse = attention_forward(q, k, v, *args, backend="cudnn")
        attention_backward(dout, q, k, v, out, lse, *args, backend="cudnn")
        builds.append(dict(cudnn_frontend.plan_builds))
    assert builds[1] == builds[0], (
        f"plans built: after the first call {builds[0]}, after the second {builds[1]}"
    )


def test_auto_backend_on_cuda_bf16_is_a_gpu_kernel():
    usable = available_backends(torch.device("cuda"), torch.bfloat16)
    assert usable[0] in ("cudnn", "torch_varlen", "flash_attn")
    assert available_backends(torch.device("cuda"), torch.float32) == ["reference"]


def _torch_older_than(version: tuple[int, int]) -> bool:
    return tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) < version


def _bf16_llama(**overrides):
    """tests/test_attention_hf.py's tiny Llama (random weights of seed 0, vocabulary 128) 256 wide, with 4
    query and 2 KV heads of 64, in bf16 on CUDA under distca."""
    from test_attention_hf import tiny_model

    model = tiny_model("llama", hidden_size=256, head_dim=64, intermediate_size=512, **overrides)
    return model.to("cuda", torch.bfloat16)


def test_tiny_llama_bf16_on_cuda_matches_per_document_sdpa():
    """The whole path on GPU: a bf16 model under distca (CUDA kernel) vs SDPA one document at a time."""
    from test_attention_hf import packed_batch, random_docs

    model = _bf16_llama(max_position_embeddings=4096, initializer_range=0.05)
    docs = random_docs([1, 7, 300, 33, 1000, 129], seed=1)
    batch = packed_batch(docs)
    batch = {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        got = model(**batch, use_cache=False).logits[0].float()  # (T, V)
        model.set_attn_implementation("sdpa")
        want = torch.cat(
            [
                model(input_ids=torch.tensor([d], device="cuda"), use_cache=False).logits[0].float()
                for d in docs
            ]
        )
    # bf16 model: compare relative to the logits' scale (TOL["gpu_out"] rtol as a fraction of max |logit|)
    rtol, _ = TOL["gpu_out"]
    err = (got - want).abs().max().item()
    assert err <= rtol * want.abs().max().item(), f"max |distca - sdpa| = {err}"
    # and boundaries matter at this scale: one causal row over everything is far off
    with torch.no_grad():
        model.set_attn_implementation("distca")
        pos = torch.arange(got.shape[0], device="cuda")[None]
        wrong = model(input_ids=batch["input_ids"], position_ids=pos, use_cache=False).logits[0].float()
    assert (wrong - want).abs().max().item() > 5 * err


@pytest.mark.parametrize("backend", _usable())
def test_compiled_layers_on_cuda_match_eager(backend):
    """Each decoder layer compiled by Inductor (fullgraph) with a DistCA layout and rematerialization-aware
    checkpointing: the loss and gradients of eager, within bf16 rounding; attention is not recomputed."""
    import copy

    import hf_distca
    from hf_distca import metrics
    from hf_distca.data.loader import DistCALayout

    # LlamaConfig's own max_position_embeddings and initializer_range
    model = _bf16_llama(max_position_embeddings=2048, initializer_range=0.02, use_cache=False)
    model.train()
    eager = copy.deepcopy(model)
    for m in (model, eager):
        hf_distca.enable_distca(m, config=hf_distca.DistCAConfig(backend=backend))
        hf_distca.enable_remat_checkpointing(m)
    for layer in model.model.layers:
        layer.compile(fullgraph=True)
    lens = [300, 1000, 129, 7]
    pieces = tuple((d, 0, n) for d, n in enumerate(lens))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (1, sum(lens)), generator=g).cuda()
    positions = torch.cat([torch.arange(n) for n in lens])[None].cuda()

    def run(m):
        layout = DistCALayout(pieces=pieces, all_pieces=(pieces,))
        out = m(input_ids=ids, position_ids=positions, labels=ids, distca_layout=layout)
        out.loss.backward()
        return out.loss.detach().float(), {n: p.grad.float() for n, p in m.named_parameters()}

    want_loss, want = run(eager)
    if _torch_older_than(TRACED_REMAT_MIN_TORCH):
        with pytest.raises(Exception, match="checkpointing traced inside torch.compile needs torch >= "):
            run(model)  # Transformers >= 5.25 checkpoints inside the compiled layer: refused on old torch
        return
    run(model)  # compiles
    model.zero_grad()
    metrics.reset()
    got_loss, got = run(model)
    assert metrics.snapshot().attn_fwd_kernels == model.config.num_hidden_layers
    rtol, _ = TOL["gpu_out"]
    assert abs(got_loss - want_loss) <= rtol * abs(want_loss)
    for name, ref in want.items():
        err = (got[name] - ref).abs().max().item()
        assert err <= 4 * rtol * ref.abs().max().item(), f"{name}: max |compiled - eager| = {err}"


@pytest.mark.parametrize("remat", [False, True])
def test_cuda_graphs_around_the_attention_ops_give_eager_numbers_for_every_layout(remat):
    """Each decoder layer compiled with ``mode="reduce-overhead"`` (CUDA graphs), with or without
    rematerialization-aware checkpointing: the attention ops run between the captured partitions, so layouts
    of the same shape but other documents (and the first layout again) give eager's loss and gradients,
    attention not recomputed."""
    import copy

    import hf_distca
    from hf_distca import metrics
    from hf_distca.data.loader import DistCALayout

    model = _bf16_llama(max_position_embeddings=2048, initializer_range=0.02, use_cache=False)
    model.train()
    eager = copy.deepcopy(model)
    for m in (model, eager):
        hf_distca.enable_distca(m)
        if remat:
            hf_distca.enable_remat_checkpointing(m)
    for layer in model.model.layers:
        layer.compile(mode="reduce-overhead", fullgraph=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (1, 1436), generator=g).cuda()

    def run(m, lens):
        pieces = tuple((d, 0, n) for d, n in enumerate(lens))
        positions = torch.cat([torch.arange(n) for n in lens])[None].cuda()
        layout = DistCALayout(pieces=pieces, all_pieces=(pieces,))
        torch.compiler.cudagraph_mark_step_begin()
        m.zero_grad()
        out = m(input_ids=ids, position_ids=positions, labels=ids, distca_layout=layout)
        out.loss.backward()
        return out.loss.detach().float(), {n: p.grad.float().clone() for n, p in m.named_parameters()}

    if remat and _torch_older_than(TRACED_REMAT_MIN_TORCH):
        with pytest.raises(Exception, match="checkpointing traced inside torch.compile needs torch >= "):
            run(model, [1436])
        return
    from torch._dynamo.utils import counters

    counters.clear()
    rtol, _ = TOL["gpu_out"]
    for step, lens in enumerate([[300, 1000, 129, 7]] * 3 + [[700, 600, 136], [1436], [300, 1000, 129, 7]]):
        want_loss, want = run(eager, lens)
        metrics.reset()
        got_loss, got = run(model, lens)
        msg = f"step {step}, documents {lens}"
        assert metrics.snapshot().attn_fwd_kernels == model.config.num_hidden_layers, msg
        assert abs(got_loss - want_loss) <= rtol * abs(want_loss), msg
        for name, ref in want.items():
            err = (got[name] - ref).abs().max().item()
            assert err <= 4 * rtol * ref.abs().max().item(), (
                f"{msg}, {name}: max |cuda graphs - eager| = {err}"
            )
    # Inductor captured the partitions around the ops instead of giving up CUDA graphs for these layers
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
