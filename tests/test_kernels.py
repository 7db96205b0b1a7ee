"""Kernel forward/backward of every CPU-runnable backend against two oracles; backend resolution; refusals.

Oracle (a) is written independently of hf_distca.kernels: one sequence at a time, an explicit boolean
mask filled row by row, torch.softmax in float64, gradients by torch.autograd of that. Oracle (b) is
torch.autograd of the reference backend's differentiable forward (the closed-form backward must agree
with the autograd of the forward it belongs to).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from oracle import visible
from tolerances import TOL

from hf_distca.engine import local_attention
from hf_distca.kernels import (
    KERNEL_BACKENDS,
    UnsupportedFeatureError,
    attention_backward,
    attention_forward,
    available_backends,
    cudnn_backend,
    cudnn_calls,
    reference,
    reference_varlen_attention,
    resolve_backend,
    sinks_backward,
)
from hf_distca.kernels.common import ForwardTensors, VarlenOffsets, check_inputs

CPU_BACKENDS = available_backends(torch.device("cpu"), torch.float32)


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_lens: list[int],
    k_lens: list[int],
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Oracle: per sequence, bottom-right causal mask[i, j] = j <= i + (lk - lq) (and, with a sliding
    window, i + (lk - lq) - j < window: oracle.visible); float64; returns (out, lse). ``softcap``: scores
    -> softcap * tanh(scores / softcap) before the mask (Gemma 2's eager attention). ``sinks`` (Hq,): a
    softmax over [scores, sink[h]] whose last column is dropped (gpt-oss's eager attention); lse then
    covers the sink column too."""
    groups = q.shape[1] // k.shape[1]
    outs, lses = [q[:0].double()], [q[:0, :, 0].double()]
    q0 = k0 = 0
    for lq, lk in zip(q_lens, k_lens):
        qs = q[q0 : q0 + lq].double()  # (lq, Hq, D)
        ks = k[k0 : k0 + lk].double().repeat_interleave(groups, dim=1)  # (lk, Hq, D)
        vs = v[k0 : k0 + lk].double().repeat_interleave(groups, dim=1)  # (lk, Hq, D)
        mask = torch.zeros(lq, lk, dtype=torch.bool)
        for i in range(lq):
            mask[i, : i + (lk - lq) + 1] = True
        if window is not None:
            mask = visible(lq, lk, window)
        scores = torch.einsum("ihd,jhd->hij", qs, ks) * scale  # (Hq, lq, lk)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            sink = sinks.double().view(-1, 1, 1).expand(-1, lq, 1)  # (Hq, lq, 1)
            scores = torch.cat([scores, sink], dim=-1)  # (Hq, lq, lk + 1)
        probs = torch.softmax(scores, dim=-1)
        if sinks is not None:
            probs = probs[..., :-1]  # the sink column carries no value
        outs.append(torch.einsum("hij,jhd->ihd", probs, vs))  # (lq, Hq, D)
        lses.append(torch.logsumexp(scores, dim=-1).transpose(0, 1))  # (lq, Hq)
        q0 += lq
        k0 += lk
    return torch.cat(outs), torch.cat(lses)


def naive_grads(q, k, v, dout, q_lens, k_lens, scale, window=None, softcap=None, sinks=None):
    """dq, dk, dv (and with ``sinks`` dsinks) of sum(naive_attention(q, k, v) * dout), float64."""
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    if sinks is not None:
        leaves.append(sinks.detach().double().requires_grad_(True))
    out, _ = naive_attention(*leaves[:3], q_lens, k_lens, scale, window, softcap, *leaves[3:])
    (out * dout.double()).sum().backward()
    return tuple(t.grad for t in leaves)


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def _inputs(q_lens, k_lens, hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), hq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(sum(k_lens), hkv, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(sum(k_lens), hkv, d, generator=g, dtype=torch.float64).to(dtype)
    dout = torch.randn(sum(q_lens), hq, d, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, dout


# (q_lens, k_lens)
SHAPES = {
    # whole documents (prefix-aligned: len_q == len_k), incl. a 1-token document
    "whole_docs": ([5, 1, 17, 40], [5, 1, 17, 40]),
    # CA-task suffix shards: queries are the last positions of a longer KV prefix (cu_q != cu_k)
    "suffix_tasks": ([3, 1, 20, 7], [10, 1, 50, 7]),
    # length-1 queries over 1, 9, 2 keys
    "length_one": ([1, 1, 1], [1, 9, 2]),
    # empty documents (0 queries, 0 keys) and 0-query sequences that still hold keys (zero dk/dv)
    "empty_and_kv_only": ([0, 4, 0, 0, 6, 0], [0, 4, 5, 0, 9, 3]),
    # prefix and suffix sequences mixed in one call
    "mixed": ([16, 2, 9, 1], [16, 30, 9, 4]),
}
SCALE = 0.37  # custom, not 1/sqrt(d)


def _tol(dtype):
    return TOL["kernel_fp64" if dtype == torch.float64 else "fp32"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("case", sorted(SHAPES))
def test_forward_backward_match_naive_oracle(case, hq, hkv, dtype, backend):
    q_lens, k_lens = SHAPES[case]
    q, k, v, dout = _inputs(q_lens, k_lens, hq, hkv, 16, dtype, seed=len(case))
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    args = (cu_q, cu_k, max(q_lens), max(k_lens))
    out, lse = attention_forward(q, k, v, *args, scale=SCALE, backend=backend)
    want_out, want_lse = naive_attention(q, k, v, q_lens, k_lens, SCALE)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.shape == q.shape[:2] and lse.dtype == (
        torch.float64 if dtype == torch.float64 else torch.float32
    )
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(out.double(), want_out, rtol=rtol, atol=atol)
    torch.testing.assert_close(lse.double(), want_lse, rtol=rtol, atol=atol)

    grads = attention_backward(dout, q, k, v, out, lse, *args, scale=SCALE, backend=backend)
    want = naive_grads(q, k, v, dout, q_lens, k_lens, SCALE)
    for name, got, ref, like in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
        assert got.dtype == like.dtype and got.shape == like.shape, name
        assert ref.abs().max() > 0, f"{name} of the oracle is identically zero: the case tests nothing"
        torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", ["suffix_tasks", "empty_and_kv_only", "mixed"])
def test_backward_matches_autograd_of_reference(case, backend):
    """Oracle (b): the explicit backward equals torch.autograd through the reference forward."""
    q_lens, k_lens = SHAPES[case]
    q, k, v, dout = _inputs(q_lens, k_lens, 6, 2, 8, torch.float64, seed=7)
    args = (_cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens))
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    (reference_varlen_attention(qq, kk, vv, *args, scale=SCALE) * dout).sum().backward()
    out, lse = attention_forward(q, k, v, *args, scale=SCALE, backend=backend)
    got = attention_backward(dout, q, k, v, out, lse, *args, scale=SCALE, backend=backend)
    rtol, atol = TOL["kernel_fp64"]
    for name, g, w in zip(("dq", "dk", "dv"), got, (qq.grad, kk.grad, vv.grad)):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


# (q_lens, k_lens, window): sliding-window layers. "tasks": CA-tasks of a window-8 layer, queries [a, b)
# over keys [max(0, a - 7), b): shards starting at 0, inside the window (3 -> 9: 3 earlier keys) and past
# it (20 -> 30: 7 earlier keys), a 1-query shard, a 0-query sequence; "docs": whole documents longer than
# the window; "one": window 1 (each query sees only itself)
WINDOW_SHAPES = {
    "tasks": ([5, 6, 10, 1, 0], [5, 9, 17, 2, 4], 8),
    "docs": ([30, 1, 12], [30, 1, 12], 5),
    "one": ([7, 3], [7, 5], 1),
    "mixed": ([16, 2, 9, 1], [16, 30, 9, 4], 3),
}


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", sorted(WINDOW_SHAPES))
def test_sliding_window_matches_naive_oracle(case, dtype, backend):
    q_lens, k_lens, window = WINDOW_SHAPES[case]
    q, k, v, dout = _inputs(q_lens, k_lens, 8, 2, 16, dtype, seed=3 + len(case))
    args = (_cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens))
    out, lse = attention_forward(q, k, v, *args, scale=SCALE, backend=backend, window=window)
    want_out, want_lse = naive_attention(q, k, v, q_lens, k_lens, SCALE, window)
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(out.double(), want_out, rtol=rtol, atol=atol)
    torch.testing.assert_close(lse.double(), want_lse, rtol=rtol, atol=atol)
    full, _ = naive_attention(q, k, v, q_lens, k_lens, SCALE)
    assert (full - want_out).abs().max() > 0.1, "the window cuts nothing here: the case tests nothing"
    grads = attention_backward(dout, q, k, v, out, lse, *args, scale=SCALE, backend=backend, window=window)
    want = naive_grads(q, k, v, dout, q_lens, k_lens, SCALE, window)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
        torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    local_attention(qq, kk, vv, *args, scale=SCALE, backend=backend, window=window).backward(dout)
    for name, got, ref in zip(("dq", "dk", "dv"), (qq.grad, kk.grad, vv.grad), want):
        torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


# (q_lens, k_lens, window) of the softcapping and sinks cases: whole documents and CA-task suffixes,
# a 0-query sequence, with and without a sliding window (Gemma 2 and gpt-oss alternate both)
SCORE_SHAPES = {
    "tasks": (SHAPES["mixed"][0], SHAPES["mixed"][1], None),
    "kv_only": (SHAPES["empty_and_kv_only"][0], SHAPES["empty_and_kv_only"][1], None),
    "window": (*WINDOW_SHAPES["tasks"][:2], 8),
}
SOFTCAP = 1.5  # small enough that tanh bends most scores (scores of O(1) inputs reach ~5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", sorted(SCORE_SHAPES))
def test_softcap_matches_naive_oracle(case, dtype, backend):
    """Gemma 2's logit softcapping: forward, log-sum-exp and explicit backward against the float64 oracle,
    and the differentiable operator against it too."""
    q_lens, k_lens, window = SCORE_SHAPES[case]
    q, k, v, dout = _inputs(q_lens, k_lens, 8, 2, 16, dtype, seed=21 + len(case))
    args = (_cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens))
    opts = {"scale": SCALE * 3, "backend": backend, "window": window, "softcap": SOFTCAP}
    out, lse = attention_forward(q, k, v, *args, **opts)
    want_out, want_lse = naive_attention(q, k, v, q_lens, k_lens, SCALE * 3, window, SOFTCAP)
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(out.double(), want_out, rtol=rtol, atol=atol)
    torch.testing.assert_close(lse.double(), want_lse, rtol=rtol, atol=atol)
    plain, _ = naive_attention(q, k, v, q_lens, k_lens, SCALE * 3, window)
    assert (plain - want_out).abs().max() > 0.1, "the softcap changes nothing here: the case tests nothing"
    grads = attention_backward(dout, q, k, v, out, lse, *args, **opts)
    want = naive_grads(q, k, v, dout, q_lens, k_lens, SCALE * 3, window, SOFTCAP)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
        torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    local_attention(qq, kk, vv, *args, **opts).backward(dout)
    for name, got, ref in zip(("dq", "dk", "dv"), (qq.grad, kk.grad, vv.grad), want):
        torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def _sinks(hq: int, dtype: torch.dtype, seed: int = 5) -> torch.Tensor:
    """Per-head sink logits around the rows' log-sum-exp (~2-4 here), so p_sink spans ~0.05-0.9."""
    return (torch.randn(hq, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2 + 2).to(
        dtype
    )


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", sorted(SCORE_SHAPES))
def test_sinks_match_naive_oracle(case, dtype, backend):
    """gpt-oss's attention sinks: output and log-sum-exp (over scores and the sink), then the unchanged
    explicit backward (fed that lse) for dq, dk, dv and sinks_backward for the sinks, against autograd of
    the float64 oracle; and the differentiable operator (gradient of the sinks included)."""
    q_lens, k_lens, window = SCORE_SHAPES[case]
    q, k, v, dout = _inputs(q_lens, k_lens, 8, 2, 16, dtype, seed=31 + len(case))
    sinks = _sinks(8, dtype)
    args = (_cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens))
    opts = {"scale": SCALE, "backend": backend, "window": window}
    out, lse = attention_forward(q, k, v, *args, **opts, sinks=sinks)
    want_out, want_lse = naive_attention(q, k, v, q_lens, k_lens, SCALE, window, sinks=sinks)
    rtol, atol = _tol(dtype)
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(out.double(), want_out, rtol=rtol, atol=atol)
    torch.testing.assert_close(lse.double(), want_lse, rtol=rtol, atol=atol)
    plain, _ = naive_attention(q, k, v, q_lens, k_lens, SCALE, window)
    assert (plain - want_out).abs().max() > 0.1, "the sinks change nothing here: the case tests nothing"
    want = naive_grads(q, k, v, dout, q_lens, k_lens, SCALE, window, sinks=sinks)
    got = (*attention_backward(dout, q, k, v, out, lse, *args, **opts), sinks_backward(dout, out, lse, sinks))
    assert want[3].abs().min() > 1e-3, "a head's sink gradient vanishes: the case tests little"
    for name, g, ref in zip(("dq", "dk", "dv", "dsinks"), got, want):
        torch.testing.assert_close(g.double(), ref, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
    local_attention(*leaves[:3], *args, **opts, sinks=leaves[3]).backward(dout)
    for name, g, ref in zip(("dq", "dk", "dv", "dsinks"), (t.grad for t in leaves), want):
        torch.testing.assert_close(g.double(), ref, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def test_sinks_gradient_matches_autograd_of_reference():
    """Oracle (b) for the sinks: sinks_backward equals torch.autograd through the reference forward with
    sinks (float64), softcapping and a window included."""
    q_lens, k_lens, window = SCORE_SHAPES["window"]
    q, k, v, dout = _inputs(q_lens, k_lens, 6, 3, 8, torch.float64, seed=41)
    args = (_cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, _sinks(6, torch.float64))]
    opts = {"scale": SCALE, "window": window, "softcap": SOFTCAP}
    (reference_varlen_attention(*leaves[:3], *args, **opts, sinks=leaves[3]) * dout).sum().backward()
    out, lse = attention_forward(q, k, v, *args, **opts, sinks=leaves[3].detach())
    got = (
        *attention_backward(dout, q, k, v, out, lse, *args, **opts),
        sinks_backward(dout, out, lse, leaves[3]),
    )
    rtol, atol = TOL["kernel_fp64"]
    for name, g, leaf in zip(("dq", "dk", "dv", "dsinks"), got, leaves):
        torch.testing.assert_close(g, leaf.grad, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def test_softcap_refused_by_backends_without_it(monkeypatch):
    """cudnn and torch_varlen cannot softcap: an explicit choice raises naming flash_attn and reference,
    and 'auto' takes flash_attn when it is there, refuses rather than fall back to the slow reference
    on a GPU, and is the reference on the CPU."""
    import hf_distca.kernels as kernels

    q, k, v, _ = _inputs([4], [4], 2, 2, 4, torch.float32)
    seqs = check_inputs(q, k, v, VarlenOffsets(_cu([4]), _cu([4]), 4, 4), None, 30.0)
    for name in ("cudnn", "torch_varlen"):
        with pytest.raises(
            UnsupportedFeatureError, match=r"softcapping \(softcap=30.0: Gemma 2.*'flash_attn'.*'reference'"
        ):
            kernels._check_features(seqs, name)
    kernels._check_features(seqs, "reference")
    cuda = torch.device("cuda")
    monkeypatch.setattr(
        kernels, "available_backends", lambda device, dtype: ["cudnn", "torch_varlen", "reference"]
    )
    assert resolve_backend("auto", cuda, torch.bfloat16) == "cudnn"
    with pytest.raises(UnsupportedFeatureError, match=r"'cudnn' cannot compute attention logit softcapping"):
        resolve_backend("auto", cuda, torch.bfloat16, softcap=30.0)
    monkeypatch.setattr(
        kernels, "available_backends", lambda device, dtype: ["cudnn", "flash_attn", "reference"]
    )
    flash = dataclasses.replace(kernels._BACKENDS["flash_attn"], softcap=lambda: True)
    monkeypatch.setitem(kernels._BACKENDS, "flash_attn", flash)
    assert resolve_backend("auto", cuda, torch.bfloat16, softcap=30.0) == "flash_attn"
    monkeypatch.undo()
    assert resolve_backend("auto", torch.device("cpu"), torch.float32, softcap=30.0) == "reference"
    with pytest.raises(ValueError, match="softcap must be a positive"):
        attention_forward(q, k, v, _cu([4]), _cu([4]), 4, 4, softcap=-1.0)
    with pytest.raises(ValueError, match=r"sinks must hold one logit per query head, shaped \(2,\)"):
        attention_forward(q, k, v, _cu([4]), _cu([4]), 4, 4, sinks=torch.zeros(3))


def test_window_semantics_match_transformers():
    """The kernels' window is Transformers' sliding_window_causal_mask_function: 0 <= i - j < window."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    fn = sliding_window_causal_mask_function(4)
    t = torch.tensor
    hf = torch.tensor([[bool(fn(t(0), t(0), t(i), t(j))) for j in range(9)] for i in range(9)])
    assert torch.equal(hf, visible(9, 9, 4)) and hf.sum(1).tolist() == [1, 2, 3, 4, 4, 4, 4, 4, 4]
    # closed form: q = 0 makes attention uniform over the visible keys, whatever they are
    _, k, v, _ = _inputs([3], [6], 1, 1, 4, torch.float64, seed=1)
    q = torch.zeros(3, 1, 4, dtype=torch.float64)
    out, lse = attention_forward(q, k, v, _cu([3]), _cu([6]), 3, 6, scale=1.0, window=2)
    expected = torch.stack([v[2:4, 0].mean(0), v[3:5, 0].mean(0), v[4:6, 0].mean(0)])  # positions 3, 4, 5
    rtol, atol = TOL["closed_form"]
    torch.testing.assert_close(out[:, 0], expected, rtol=rtol, atol=atol)
    torch.testing.assert_close(lse[:, 0], torch.log(torch.full((3,), 2.0, dtype=torch.float64)))


def test_window_covering_every_sequence_is_causal():
    q_lens, k_lens = SHAPES["mixed"]
    q, k, v, dout = _inputs(q_lens, k_lens, 4, 2, 8, torch.float64, seed=9)
    args = (_cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens))
    causal = attention_forward(q, k, v, *args)
    wide = attention_forward(q, k, v, *args, window=max(k_lens))
    assert torch.equal(causal[0], wide[0]) and torch.equal(causal[1], wide[1])
    with pytest.raises(ValueError, match="window must be a positive int"):
        attention_forward(q, k, v, *args, window=0)


def test_kv_only_sequences_get_zero_gradients():
    q_lens, k_lens = SHAPES["empty_and_kv_only"]
    q, k, v, dout = _inputs(q_lens, k_lens, 4, 2, 8, torch.float64, seed=3)
    args = (_cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens))
    out, lse = attention_forward(q, k, v, *args)
    _, dk, dv = attention_backward(dout, q, k, v, out, lse, *args)
    kv_only = torch.zeros(sum(k_lens), dtype=torch.bool)
    for (a, b), lq in zip(zip(_cu(k_lens)[:-1].tolist(), _cu(k_lens)[1:].tolist()), q_lens):
        kv_only[a:b] = lq == 0
    assert kv_only.sum() == 8
    assert torch.all(dk[kv_only] == 0) and torch.all(dv[kv_only] == 0)
    assert torch.all(dk[~kv_only].abs().sum((1, 2)) > 0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_local_attention_autograd_function(dtype):
    """The differentiable convenience: forward = attention_forward, gradients = the naive oracle's."""
    q_lens, k_lens = SHAPES["mixed"]
    q, k, v, dout = _inputs(q_lens, k_lens, 8, 2, 16, dtype, seed=11)
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = local_attention(qq, kk, vv, _cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens))
    out.backward(dout)
    scale = 1 / math.sqrt(16)  # the default
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(
        out.double(), naive_attention(q, k, v, q_lens, k_lens, scale)[0], rtol=rtol, atol=atol
    )
    for name, g, w in zip(
        "qkv", (qq.grad, kk.grad, vv.grad), naive_grads(q, k, v, dout, q_lens, k_lens, scale)
    ):
        torch.testing.assert_close(g.double(), w, rtol=rtol, atol=atol, msg=lambda m, n=name: f"d{n}: {m}")


def test_empty_batch():
    q, k, v, dout = _inputs([0], [5], 4, 2, 8, torch.float32)
    args = (_cu([0]), _cu([5]), 0, 5)
    out, lse = attention_forward(q, k, v, *args)
    assert out.shape == (0, 4, 8) and lse.shape == (0, 4)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, *args)
    assert dq.shape == (0, 4, 8) and torch.all(dk == 0) and torch.all(dv == 0) and dk.shape == k.shape
    kk = k.clone().requires_grad_(True)
    local_attention(q, kk, v, *args).sum().backward()
    assert torch.all(kk.grad == 0)


def test_query_chunks_are_seamless(monkeypatch):
    """The reference processes queries in chunks: chunk boundaries (3 rows) must not change any number."""
    q_lens, k_lens = [10, 7], [13, 7]
    q, k, v, dout = _inputs(q_lens, k_lens, 4, 2, 8, torch.float64, seed=5)
    args = (_cu(q_lens), _cu(k_lens), 10, 13)
    monkeypatch.setattr(reference, "_Q_CHUNK", 3)
    out, lse = attention_forward(q, k, v, *args, scale=SCALE)
    grads = attention_backward(dout, q, k, v, out, lse, *args, scale=SCALE)
    want_out, want_lse = naive_attention(q, k, v, q_lens, k_lens, SCALE)
    rtol, atol = TOL["kernel_fp64"]
    torch.testing.assert_close(out, want_out, rtol=rtol, atol=atol)
    torch.testing.assert_close(lse, want_lse, rtol=rtol, atol=atol)
    for g, w in zip(grads, naive_grads(q, k, v, dout, q_lens, k_lens, SCALE)):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol)


def test_bottom_right_alignment_closed_form():
    """q = 0 makes attention uniform over the visible keys: out = mean of visible v (independent of the oracle)."""
    q_lens, k_lens = [2, 1], [4, 3]
    _, k, v, _ = _inputs(q_lens, k_lens, 2, 1, 4, torch.float64, seed=2)
    q = torch.zeros(3, 2, 4, dtype=torch.float64)
    out, lse = attention_forward(q, k, v, _cu(q_lens), _cu(k_lens), 2, 4, scale=1.0)
    expected = torch.stack(
        [
            v[0:3, 0].mean(0),  # sequence 0, query 0 (position 2 of 4) sees keys 0..2
            v[0:4, 0].mean(0),  # sequence 0, query 1 (last) sees keys 0..3
            v[4:7, 0].mean(0),  # sequence 1, its single query is the last: sees all 3 keys
        ]
    )  # (3, D)
    rtol, atol = TOL["closed_form"]
    torch.testing.assert_close(out[:, 0], expected, rtol=rtol, atol=atol)
    torch.testing.assert_close(out[:, 1], expected, rtol=rtol, atol=atol)  # GQA: both heads share kv head 0
    torch.testing.assert_close(lse[:, 0], torch.log(torch.tensor([3.0, 4.0, 3.0], dtype=torch.float64)))


def test_lse_is_float32_for_low_precision_inputs():
    q, k, v, _ = _inputs([5], [5], 2, 2, 8, torch.bfloat16)
    out, lse = attention_forward(q, k, v, _cu([5]), _cu([5]), 5, 5)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------------
# bad input


def test_more_queries_than_keys_raises():
    q, k, v, dout = _inputs([2, 4], [2, 3], 2, 2, 4, torch.float64)
    args = (_cu([2, 4]), _cu([2, 3]), 4, 3)
    with pytest.raises(ValueError, match="sequence 1: 4 queries but only 3 keys"):
        attention_forward(q, k, v, *args)
    with pytest.raises(ValueError, match="at least as many keys as queries"):
        attention_backward(dout, q, k, v, dout, dout[..., 0], *args)
    with pytest.raises(ValueError, match="at least as many keys as queries"):
        local_attention(q, k, v, *args)


def test_bad_shapes_raise():
    q, k, v, dout = _inputs([4], [4], 3, 2, 4, torch.float32)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attention_forward(q, k, v, _cu([4]), _cu([4]), 4, 4)
    q, k, v, dout = _inputs([4], [4], 2, 2, 4, torch.float32)
    with pytest.raises(ValueError, match="same number of entries"):
        attention_forward(q, k, v, _cu([4]), _cu([2, 2]), 4, 4)
    with pytest.raises(ValueError, match="end at the tensor's row count 4"):
        attention_forward(q, k, v, _cu([3]), _cu([4]), 4, 4)
    with pytest.raises(ValueError, match="max_seqlen_q/k"):
        attention_forward(q, k, v, _cu([4]), _cu([4]), 2, 4)
    with pytest.raises(ValueError, match="share one dtype"):
        attention_forward(q, k.double(), v, _cu([4]), _cu([4]), 4, 4)
    out, lse = attention_forward(q, k, v, _cu([4]), _cu([4]), 4, 4)
    with pytest.raises(ValueError, match=r"lse must be shaped \(Tq, Hq\)"):
        attention_backward(dout, q, k, v, out, lse.t(), _cu([4]), _cu([4]), 4, 4)


# ---------------------------------------------------------------------------------------------------------
# backend resolution


def test_backend_names_come_from_config():
    assert KERNEL_BACKENDS[0] == "auto" and "reference" in KERNEL_BACKENDS
    for name in KERNEL_BACKENDS[1:]:
        # every configured name resolves to itself or raises the "cannot run here" error, never "unknown"
        try:
            assert resolve_backend(name, torch.device("cpu"), torch.float32) == name
        except UnsupportedFeatureError as err:
            assert "cannot run here" in str(err)


def test_auto_backend_on_cpu_is_reference():
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        assert resolve_backend("auto", torch.device("cpu"), dtype) == "reference"
        assert available_backends(torch.device("cpu"), dtype) == ["reference"]


@pytest.mark.parametrize("backend", [b for b in KERNEL_BACKENDS if b not in ("auto", "reference")])
def test_explicit_gpu_backend_on_cpu_raises_helpful_error(backend):
    with pytest.raises(
        UnsupportedFeatureError, match=rf"backend '{backend}' cannot run here.*backend='auto'"
    ):
        resolve_backend(backend, torch.device("cpu"), torch.bfloat16)
    q, k, v, dout = _inputs([4], [4], 2, 2, 4, torch.bfloat16)
    with pytest.raises(UnsupportedFeatureError, match="cannot run here"):
        attention_forward(q, k, v, _cu([4]), _cu([4]), 4, 4, backend=backend)
    with pytest.raises(UnsupportedFeatureError, match="cannot run here"):
        local_attention(q, k, v, _cu([4]), _cu([4]), 4, 4, backend=backend)


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="unknown kernel backend 'triton'"):
        resolve_backend("triton", torch.device("cpu"), torch.float32)


def test_cudnn_options_with_another_backend_raise():
    q, k, v, dout = _inputs([4], [4], 2, 2, 4, torch.float32)
    args = (_cu([4]), _cu([4]), 4, 4)
    options = cudnn_backend.CudnnOptions(suffix_strategy="bottom_right")
    with pytest.raises(ValueError, match="cudnn_options apply to the cudnn backend only"):
        attention_forward(q, k, v, *args, backend="reference", cudnn_options=options)
    out, lse = attention_forward(q, k, v, *args, backend="reference")
    with pytest.raises(ValueError, match="cudnn_options apply to the cudnn backend only"):
        attention_backward(dout, q, k, v, out, lse, *args, backend="reference", cudnn_options=options)


# ---------------------------------------------------------------------------------------------------------
# cudnn backend: its host-side planning (alignment groups, suffix split and lse merge, side buffers) with
# every cuDNN launch replaced by an emulation that honours the same contract (per call: sequences at
# ragged row offsets, one mask, writes only its own rows). The cuDNN kernels themselves: tests/test_gpu.py.


def _emulated_scores(call, j, q, k, scale):
    """Float64 scores (Hq, lq, lk) of sequence j of a call, masked by the call's alignment."""
    lq, lk = call.q_lens[j], call.k_lens[j]
    qs = q[call.q_rows[j] : call.q_rows[j] + lq].double()  # (lq, Hq, D)
    groups = q.shape[1] // k.shape[1]
    ks = k[call.k_rows[j] : call.k_rows[j] + lk].double().repeat_interleave(groups, dim=1)  # (lk, Hq, D)
    scores = torch.einsum("ihd,jhd->hij", qs, ks) * scale
    i = torch.arange(lq).unsqueeze(1)
    c = torch.arange(lk).unsqueeze(0)
    shift = lk - lq if call.mask == cudnn_calls.BOTTOM_RIGHT else 0
    seen = {
        cudnn_calls.TOP_LEFT: c <= i,
        cudnn_calls.BOTTOM_RIGHT: c <= i + shift,
        cudnn_calls.FULL: c >= 0,
    }[call.mask]
    if call.window is not None:  # diagonal_band_left_bound = window
        assert call.mask != cudnn_calls.FULL, call
        seen = seen & (c > i + shift - call.window)
    return scores.masked_fill(~seen, float("-inf"))


def _emulated_forward(call, q, k, v, out, lse, scale, *, bucket_shapes):
    groups = q.shape[1] // k.shape[1]
    for j in range(call.num_seqs):
        scores = _emulated_scores(call, j, q, k, scale)
        vs = v[call.k_rows[j] : call.k_rows[j] + call.k_lens[j]].double().repeat_interleave(groups, dim=1)
        rows = slice(call.out_rows[j], call.out_rows[j] + call.q_lens[j])
        out[rows] = torch.einsum("hij,jhd->ihd", torch.softmax(scores, -1), vs).to(out.dtype)
        lse[rows] = torch.logsumexp(scores, -1).transpose(0, 1).to(lse.dtype)


def _emulated_backward(call, dout, fwd, grads, scale, *, bucket_shapes):
    # the backend's contract with cuDNN's backward: every launch is packed (sequences back to back from
    # row 0 on the query side and on the key side)
    (q, k, v, out, lse), (dq, dk, dv) = fwd, grads
    starts = cudnn_calls.packed_starts
    assert call.q_rows == call.out_rows == starts(call.q_lens) and call.k_rows == starts(call.k_lens), call
    hkv, groups = k.shape[1], q.shape[1] // k.shape[1]
    for j in range(call.num_seqs):
        lq, lk = call.q_lens[j], call.k_lens[j]
        qrows = slice(call.q_rows[j], call.q_rows[j] + lq)
        krows = slice(call.k_rows[j], call.k_rows[j] + lk)
        ks = k[krows].double().repeat_interleave(groups, dim=1)  # (lk, Hq, D)
        vs = v[krows].double().repeat_interleave(groups, dim=1)
        dos, os = dout[qrows].double(), out[qrows].double()  # (lq, Hq, D)
        probs = torch.exp(_emulated_scores(call, j, q, k, scale) - lse[qrows].double().T.unsqueeze(-1))
        dprobs = torch.einsum("ihd,jhd->hij", dos, vs)
        dscores = probs * (dprobs - (dos * os).sum(-1).T.unsqueeze(-1))  # (Hq, lq, lk)
        dq[call.out_rows[j] : call.out_rows[j] + lq] = (scale * torch.einsum("hij,jhd->ihd", dscores, ks)).to(
            dq.dtype
        )
        dk_full = scale * torch.einsum("hij,ihd->jhd", dscores, q[qrows].double())  # (lk, Hq, D)
        dv_full = torch.einsum("hij,ihd->jhd", probs, dos)
        dk[krows] = dk_full.view(lk, hkv, groups, -1).sum(2).to(dk.dtype)
        dv[krows] = dv_full.view(lk, hkv, groups, -1).sum(2).to(dv.dtype)


CUDNN_CASES = {
    **{c: (*SHAPES[c], None) for c in SHAPES},
    **{f"window_{c}": WINDOW_SHAPES[c] for c in WINDOW_SHAPES},
}


@pytest.mark.parametrize("backward_rows", [65536, 3], ids=["one_launch", "runs_of_3_rows"])
@pytest.mark.parametrize("strategy", cudnn_calls.SUFFIX_STRATEGIES)
@pytest.mark.parametrize("case", sorted(CUDNN_CASES))
def test_cudnn_host_logic_with_emulated_launches(case, strategy, backward_rows, monkeypatch):
    launches = []

    def counted(call, *args, **kwargs):
        launches.append(call.num_seqs)
        _emulated_backward(call, *args, **kwargs)

    monkeypatch.setattr(cudnn_backend, "launch_forward", _emulated_forward)
    monkeypatch.setattr(cudnn_backend, "launch_backward", counted)
    options = cudnn_backend.CudnnOptions(suffix_strategy=strategy, backward_rows=backward_rows)
    q_lens, k_lens, window = CUDNN_CASES[case]
    q, k, v, dout = _inputs(q_lens, k_lens, 8, 2, 16, torch.float32, seed=13)
    seqs = check_inputs(q, k, v, VarlenOffsets(_cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens)), window)
    out, lse = cudnn_backend.forward(q, k, v, seqs, SCALE, options)
    want_out, want_lse = naive_attention(q, k, v, q_lens, k_lens, SCALE, window)
    rtol, atol = TOL["fp32"]
    torch.testing.assert_close(out.double(), want_out, rtol=rtol, atol=atol)
    torch.testing.assert_close(lse.double(), want_lse, rtol=rtol, atol=atol)
    grads = cudnn_backend.backward(dout, ForwardTensors(q, k, v, out, lse), seqs, SCALE, options)
    want = naive_grads(q, k, v, dout, q_lens, k_lens, SCALE, window)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
        torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
    runs = [
        r for c in cudnn_calls.plan_calls(seqs, strategy) for r in cudnn_calls.split_call(c, backward_rows)
    ]
    assert launches == [r.num_seqs for r in runs]
    assert all(sum(r.q_lens) <= backward_rows or r.num_seqs == 1 for r in runs)


def test_split_call_cuts_whole_sequences_at_the_row_bound():
    call = cudnn_calls.KernelCall(
        cudnn_calls.TOP_LEFT, (0, 4, 6, 9), (0, 13, 15, 18), (4, 2, 3, 1), (4, 2, 3, 5), (0, 4, 6, 9), False
    )
    runs = cudnn_calls.split_call(call, 5)
    # 4 rows | 2 + 3 rows | 1 row over 5 keys (keys bound the run too)
    assert [(r.q_rows, r.k_rows, r.q_lens, r.k_lens, r.out_rows) for r in runs] == [
        ((0,), (0,), (4,), (4,), (0,)),
        ((4, 6), (13, 15), (2, 3), (2, 3), (4, 6)),
        ((9,), (18,), (1,), (5,), (9,)),
    ]
    assert cudnn_calls.split_call(call, 0) == (call,) and cudnn_calls.split_call(call, 100) == (call,)
    assert [r.q_lens for r in cudnn_calls.split_call(call, 1)] == [
        (4,),
        (2,),
        (3,),
        (1,),
    ]  # longer ones alone
    with pytest.raises(ValueError, match="backward_rows must be an int >= 0, got -1"):
        cudnn_backend.CudnnOptions(backward_rows=-1)


@pytest.mark.parametrize("bucket_shapes", [True, False])
def test_cudnn_options_reach_every_launch(bucket_shapes, monkeypatch):
    seen = []

    def spy(launch):
        def wrapped(*args, bucket_shapes):
            seen.append(bucket_shapes)
            launch(*args, bucket_shapes=bucket_shapes)

        return wrapped

    monkeypatch.setattr(cudnn_backend, "launch_forward", spy(_emulated_forward))
    monkeypatch.setattr(cudnn_backend, "launch_backward", spy(_emulated_backward))
    options = cudnn_backend.CudnnOptions(suffix_strategy="split", bucket_shapes=bucket_shapes)
    q_lens, k_lens = [4, 2], [4, 5]  # a whole document and a suffix task: a top-left and a side call
    q, k, v, dout = _inputs(q_lens, k_lens, 2, 2, 4, torch.float32)
    seqs = check_inputs(q, k, v, VarlenOffsets(_cu(q_lens), _cu(k_lens), 4, 5))
    out, lse = cudnn_backend.forward(q, k, v, seqs, SCALE, options)
    cudnn_backend.backward(dout, ForwardTensors(q, k, v, out, lse), seqs, SCALE, options)
    assert seen == [bucket_shapes] * 4


def test_cudnn_call_plan_groups_by_alignment():
    q_lens, k_lens = [4, 0, 2, 3, 0], [4, 6, 5, 3, 0]
    q, k, v, _ = _inputs(q_lens, k_lens, 2, 2, 4, torch.float32)
    seqs = check_inputs(q, k, v, VarlenOffsets(_cu(q_lens), _cu(k_lens), 4, 6))
    # rows: q 0-3 | - | 4-5 | 6-8 ; k 0-3 | 4-9 | 10-14 | 15-17
    grouped = cudnn_calls.plan_calls(seqs, "bottom_right")
    assert [(c.mask, c.q_rows, c.k_rows, c.q_lens, c.k_lens, c.side) for c in grouped] == [
        (cudnn_calls.TOP_LEFT, (0, 6), (0, 15), (4, 3), (4, 3), False),
        (cudnn_calls.BOTTOM_RIGHT, (4,), (10,), (2,), (5,), False),
    ]
    split = cudnn_calls.plan_calls(seqs, "split")
    assert [(c.mask, c.q_rows, c.k_rows, c.q_lens, c.k_lens, c.out_rows, c.side) for c in split] == [
        # the suffix sequence's causal square over its last 2 keys (rows 13-14) joins the top-left call
        (cudnn_calls.TOP_LEFT, (0, 4, 6), (0, 13, 15), (4, 2, 3), (4, 2, 3), (0, 4, 6), False),
        # and its 3 earlier keys (rows 10-12) run non-causal into side rows 0-1
        (cudnn_calls.FULL, (4,), (10,), (2,), (3,), (0,), True),
    ]
    with pytest.raises(ValueError, match="suffix_strategy"):
        cudnn_calls.plan_calls(seqs, "top_left")
    with pytest.raises(ValueError, match="suffix_strategy"):
        cudnn_backend.CudnnOptions(suffix_strategy="top_left")


def test_cudnn_plan_buckets():
    """Batch sizes and lengths round up <= 25% (4 steps per octave), never below the minimum."""
    assert [cudnn_calls.bucket(n, 1) for n in (1, 2, 5, 9, 17, 100)] == [1, 2, 5, 10, 20, 112]
    assert [cudnn_calls.bucket(n, 128) for n in (1, 128, 129, 1000, 65536, 65537)] == [
        128,
        128,
        160,
        1024,
        65536,
        81920,
    ]
    for n in range(129, 70000, 97):
        assert n <= cudnn_calls.bucket(n, 128) <= 1.25 * n
    # a training run's varying lengths map to few plans: every length in (32K, 64K] -> 4 buckets
    assert {cudnn_calls.bucket(n, 128) for n in range(32769, 65537)} == {40960, 49152, 57344, 65536}
