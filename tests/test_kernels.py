"""The CPU reference kernel against a naive per-sequence oracle, backend resolution, refusals.

The oracle below is written independently of hf_distca.kernels: one sequence at a time, an explicit
boolean mask built by a double loop's worth of comparisons, torch.softmax in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import TOL

from hf_distca.kernels import (
    UnsupportedFeatureError,
    available_backends,
    reference_varlen_attention,
    resolve_backend,
    varlen_attention,
)


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_lens: list[int],
    k_lens: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Oracle: per sequence, bottom-right causal mask[i, j] = j <= i + (lk - lq); float64; returns (out, lse)."""
    groups = q.shape[1] // k.shape[1]
    outs, lses = [], []
    q0 = k0 = 0
    for lq, lk in zip(q_lens, k_lens):
        qs = q[q0 : q0 + lq].double()  # (lq, Hq, D)
        ks = k[k0 : k0 + lk].double().repeat_interleave(groups, dim=1)  # (lk, Hq, D)
        vs = v[k0 : k0 + lk].double().repeat_interleave(groups, dim=1)  # (lk, Hq, D)
        mask = torch.zeros(lq, lk, dtype=torch.bool)
        for i in range(lq):
            mask[i, : i + (lk - lq) + 1] = True
        scores = torch.einsum("ihd,jhd->hij", qs, ks) * scale  # (Hq, lq, lk)
        scores = scores.masked_fill(~mask, float("-inf"))
        outs.append(torch.einsum("hij,jhd->ihd", torch.softmax(scores, dim=-1), vs))  # (lq, Hq, D)
        lses.append(torch.logsumexp(scores, dim=-1).transpose(0, 1))  # (lq, Hq)
        q0 += lq
        k0 += lk
    return torch.cat(outs), torch.cat(lses)


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _inputs(q_lens, k_lens, hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), hq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(sum(k_lens), hkv, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(sum(k_lens), hkv, d, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


# (q_lens, k_lens): whole documents, CA-task shards (a query shard at the end of its KV prefix),
# length-1 sequences and a shard longer than the reference kernel's 1024-query chunk.
SHAPES = {
    "whole_docs": ([5, 1, 17, 64], [5, 1, 17, 64]),
    "q_shards_kv_prefix": ([3, 1, 20, 7], [10, 1, 50, 7]),
    "length_one": ([1, 1, 1], [1, 9, 2]),
    "long_shard_chunked": ([1100], [1300]),
}


@pytest.mark.parametrize("case", sorted(SHAPES))
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (8, 2)])
def test_reference_matches_oracle_fp64(case, hq, hkv):
    q_lens, k_lens = SHAPES[case]
    d = 8 if case == "long_shard_chunked" else 16
    q, k, v = _inputs(q_lens, k_lens, hq, hkv, d, torch.float64)
    scale = 0.37  # custom, not 1/sqrt(d)
    out, lse = reference_varlen_attention(
        q, k, v, _cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens), scale=scale, return_lse=True
    )
    ref_out, ref_lse = naive_attention(q, k, v, q_lens, k_lens, scale)
    assert out.dtype == torch.float64 and out.shape == (sum(q_lens), hq, d)
    assert lse.shape == (sum(q_lens), hq) and lse.dtype == torch.float32
    rtol, atol = TOL["kernel_fp64"]
    torch.testing.assert_close(out, ref_out, rtol=rtol, atol=atol)
    # the LSE is returned in float32 by contract: compare at float32 precision
    rtol, atol = TOL["fp32"]
    torch.testing.assert_close(lse.double(), ref_lse, rtol=rtol, atol=atol)


@pytest.mark.parametrize("case", ["whole_docs", "q_shards_kv_prefix", "length_one"])
def test_reference_matches_oracle_fp32_gqa(case):
    q_lens, k_lens = SHAPES[case]
    q, k, v = _inputs(q_lens, k_lens, 8, 2, 32, torch.float32, seed=1)
    out, lse = varlen_attention(
        q, k, v, _cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens), return_lse=True, backend="auto"
    )
    ref_out, ref_lse = naive_attention(q, k, v, q_lens, k_lens, 1 / math.sqrt(32))  # default scale
    assert out.dtype == torch.float32
    rtol, atol = TOL["fp32"]
    torch.testing.assert_close(out.double(), ref_out, rtol=rtol, atol=atol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=rtol, atol=atol)


def test_bottom_right_alignment_closed_form():
    """q = 0 makes attention uniform over the visible keys: out = mean of visible v (independent of the oracle)."""
    q_lens, k_lens = [2, 1], [4, 3]
    q = torch.zeros(3, 2, 4, dtype=torch.float64)
    _, k, v = _inputs(q_lens, k_lens, 2, 1, 4, torch.float64, seed=2)
    out, lse = reference_varlen_attention(q, k, v, _cu(q_lens), _cu(k_lens), 2, 4, scale=1.0, return_lse=True)
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
    torch.testing.assert_close(lse[:, 0].double(), torch.log(torch.tensor([3.0, 4.0, 3.0])).double())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_reference_gradients_match_oracle(dtype):
    q_lens, k_lens = [3, 1, 9, 1], [8, 1, 9, 4]
    q, k, v = _inputs(q_lens, k_lens, 6, 2, 8, dtype, seed=3)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    scale = 0.5

    def grads(fn):
        qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        out = fn(qq, kk, vv)
        (out.double() * dout).sum().backward()
        return qq.grad.double(), kk.grad.double(), vv.grad.double()

    got = grads(
        lambda a, b, c: reference_varlen_attention(a, b, c, _cu(q_lens), _cu(k_lens), 9, 9, scale=scale)
    )
    want = grads(lambda a, b, c: naive_attention(a, b, c, q_lens, k_lens, scale)[0])
    rtol, atol = TOL["kernel_fp64" if dtype == torch.float64 else "fp32"]
    for name, g, w in zip("qkv", got, want):
        assert g.abs().max() > 0, f"d{name} is identically zero"
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=lambda m, n=name: f"d{n}: {m}")


def test_empty_query_sequence_is_skipped():
    """A sequence with 0 queries (a KV-only entry) contributes nothing and shifts nothing."""
    q_lens, k_lens = [2, 0, 3], [2, 5, 3]
    q, k, v = _inputs(q_lens, k_lens, 2, 2, 4, torch.float64, seed=5)
    out = reference_varlen_attention(q, k, v, _cu(q_lens), _cu(k_lens), 3, 5, scale=0.5)
    ref = torch.cat(
        [
            naive_attention(q[:2], k[:2], v[:2], [2], [2], 0.5)[0],
            naive_attention(q[2:], k[7:], v[7:], [3], [3], 0.5)[0],
        ]
    )
    rtol, atol = TOL["kernel_fp64"]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)


def test_fewer_keys_than_queries_raises():
    q, k, v = _inputs([4], [3], 2, 2, 4, torch.float64)
    with pytest.raises(ValueError, match="at least as many keys as queries"):
        reference_varlen_attention(q, k, v, _cu([4]), _cu([3]), 4, 3, scale=1.0)


# ---------------------------------------------------------------------------------------------------------
# backend resolution


def test_auto_backend_on_cpu_is_reference():
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        assert resolve_backend("auto", torch.device("cpu"), dtype) == "reference"
        assert available_backends(torch.device("cpu"), dtype) == ["reference"]
    assert resolve_backend("reference", torch.device("cpu"), torch.float32) == "reference"


@pytest.mark.parametrize("backend", ["torch_varlen", "flash_attn"])
def test_explicit_gpu_backend_on_cpu_raises_helpful_error(backend):
    with pytest.raises(
        UnsupportedFeatureError, match=rf"backend '{backend}' cannot run here.*backend='auto'"
    ):
        resolve_backend(backend, torch.device("cpu"), torch.bfloat16)
    q, k, v = _inputs([4], [4], 2, 2, 4, torch.bfloat16)
    with pytest.raises(UnsupportedFeatureError, match="cannot run here"):
        varlen_attention(q, k, v, _cu([4]), _cu([4]), 4, 4, backend=backend)


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="unknown kernel backend 'triton'"):
        resolve_backend("triton", torch.device("cpu"), torch.float32)


# ---------------------------------------------------------------------------------------------------------
# refused features


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sliding_window": 128}, "sliding-window"),
        ({"softcap": 30.0}, "softcap"),
        ({"dropout": 0.1}, "dropout"),
        ({"sinks": torch.zeros(2)}, "sinks"),
    ],
)
def test_unsupported_features_raise(kwargs, match):
    q, k, v = _inputs([4], [4], 2, 2, 4, torch.float32)
    with pytest.raises(UnsupportedFeatureError, match=match):
        varlen_attention(q, k, v, _cu([4]), _cu([4]), 4, 4, **kwargs)


def test_bad_shapes_raise():
    q, k, v = _inputs([4], [4], 3, 2, 4, torch.float32)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        varlen_attention(q, k, v, _cu([4]), _cu([4]), 4, 4)
    q, k, v = _inputs([4], [4], 2, 2, 4, torch.float32)
    with pytest.raises(ValueError, match="same number of entries"):
        varlen_attention(q, k, v, _cu([4]), _cu([2, 2]), 4, 4)
