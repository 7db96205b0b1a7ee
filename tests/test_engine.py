"""core_attention in one process (no process group) against the oracle."""

from __future__ import annotations

import pytest
import torch
from oracle import Layout, assert_close, oracle_with_grads, random_qkv

from hf_distca import DistCAConfig, PieceError, core_attention, local_attention, metrics
from hf_distca.engine import engine_state

# Several pieces of the same document held non-adjacently in local order, a length-1 document,
# odd lengths, a document whose pieces come in reverse order, sparse document ids.
ONE_RANK = Layout(
    "one_rank",
    doc_ids=[0, 4, 9, 12],
    doc_lens=[37, 1, 23, 16],
    pieces=[[(0, 0, 10), (9, 5, 18), (0, 10, 5), (4, 0, 1), (12, 8, 8), (9, 0, 5), (0, 15, 22), (12, 0, 8)]],
)


def _run(layout: Layout, hq, hkv, d, dtype, seed, scale=None, config=None):
    q_all, k_all, v_all, w_all = random_qkv(layout.total, hq, hkv, d, dtype, seed)
    rows = torch.as_tensor(layout.rows(0))
    q, k, v = (t[rows].clone().requires_grad_(True) for t in (q_all, k_all, v_all))
    out = core_attention(
        q, k, v, layout.pieces[0], config=config or DistCAConfig(shard_tokens=8), scale=scale
    )
    (out * w_all[rows]).sum().backward()
    ref = oracle_with_grads(q_all, k_all, v_all, w_all, layout.doc_lens, scale)
    return rows, (out, q.grad, k.grad, v.grad), ref


@pytest.mark.parametrize(
    "hq, hkv, dtype, kind",
    [
        (4, 2, torch.float64, "fp64"),
        (3, 3, torch.float64, "fp64"),
        (4, 2, torch.float32, "fp32"),
        (4, 1, torch.float32, "fp32"),
    ],
)
def test_single_process_matches_oracle(hq, hkv, dtype, kind):
    rows, got, ref = _run(ONE_RANK, hq, hkv, 8, dtype, seed=7)
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert g.dtype == dtype
        assert_close(g, r[rows], kind, name)


def test_scale_argument_is_used():
    rows, got, ref = _run(ONE_RANK, 4, 2, 8, torch.float64, seed=3, scale=0.05)
    assert_close(got[0], ref[0][rows], "fp64", "out with scale")
    # and it matters: the default scale gives another result
    _, default, _ = _run(ONE_RANK, 4, 2, 8, torch.float64, seed=3)
    assert (default[0] - got[0]).abs().max() > 1e-3


def test_single_process_metrics_and_plan_cache():
    engine_state().reset()
    metrics.reset()
    layout = ONE_RANK
    q_all, k_all, v_all, _ = random_qkv(layout.total, 4, 2, 8, torch.float32, seed=1)
    rows = torch.as_tensor(layout.rows(0))
    for _ in range(3):  # three "layers": one plan
        core_attention(q_all[rows], k_all[rows], v_all[rows], layout.pieces[0])
    s = metrics.snapshot()
    pairs = sum(n * (n + 1) // 2 for n in layout.doc_lens)
    # one process: one kernel per call, nothing sent, no cross-rank check
    assert (s.calls, s.plans, s.bytes_sent, s.attn_fwd_kernels, s.checks) == (3, 1, 0, 3, 0)
    assert s.flops_before == s.flops_after == [3 * 4.0 * 4 * 8 * pairs]


def test_plan_cache_is_keyed_by_what_changes_the_plan():
    """Switching the kernel backend, ping-pong or the consistency check reuses the cached plan; a field
    that changes the plan (the tolerance) plans again."""
    engine_state().reset()
    metrics.reset()
    layout = ONE_RANK
    q_all, k_all, v_all, _ = random_qkv(layout.total, 4, 2, 8, torch.float32, seed=1)
    rows = torch.as_tensor(layout.rows(0))
    q, k, v = q_all[rows], k_all[rows], v_all[rows]
    run_only = [
        DistCAConfig(),
        DistCAConfig(backend="reference"),
        DistCAConfig(ping_pong=True, ping_pong_split="halves"),
        DistCAConfig(check_consistency=False),
    ]
    for config in run_only:
        core_attention(q, k, v, layout.pieces[0], config=config)
    assert metrics.snapshot().plans == 1
    core_attention(q, k, v, layout.pieces[0], config=DistCAConfig(tolerance=0.3))
    assert metrics.snapshot().plans == 2


def test_empty_input():
    q = torch.zeros(0, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.zeros(0, 2, 8, dtype=torch.float64, requires_grad=True)
    out = core_attention(q, k, k, [])
    assert out.shape == (0, 4, 8)
    out.sum().backward()
    # zeros, not None: the graph stays connected to k and v too (DDP-style unused-parameter checks)
    assert q.grad.shape == (0, 4, 8) and k.grad is not None and k.grad.shape == (0, 2, 8)


def test_errors():
    q = torch.zeros(10, 4, 8)
    k = torch.zeros(10, 2, 8)
    with pytest.raises(ValueError, match="pieces cover 9 tokens but q holds 10"):
        core_attention(q, k, k, [(0, 0, 9)])
    with pytest.raises(PieceError, match=r"positions \[4, 6\) are held by no rank"):
        core_attention(q, k, k, [(0, 0, 4), (0, 6, 6)])
    with pytest.raises(PieceError, match="held twice"):
        core_attention(q, k, k, [(0, 0, 6), (0, 2, 4)])
    with pytest.raises(ValueError, match=r"a piece is \(doc_id, doc_start, length\)"):
        core_attention(q, k, k, [(0, 0)])
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        core_attention(torch.zeros(10, 3, 8), k, k, [(0, 0, 10)])
    with pytest.raises(ValueError, match="all_pieces must list"):
        core_attention(q, k, k, [(0, 0, 10)], all_pieces=[[(1, 0, 10)]])
    with pytest.raises(RuntimeError, match="not initialized"):
        core_attention(q, k, k, [(0, 0, 10)], group=object())


@pytest.mark.parametrize("dtype, kind", [(torch.float64, "fp64"), (torch.float32, "fp32")])
def test_local_attention_matches_oracle(dtype, kind):
    """local_attention (the operator of the local path): whole documents, explicit forward/backward."""
    lens = [37, 1, 23, 16]
    q, k, v, w = random_qkv(sum(lens), 4, 2, 8, dtype, seed=9)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    metrics.reset()
    out = local_attention(*leaves, cu, cu, max(lens), max(lens), backend="reference")
    (out * w).sum().backward()
    assert metrics.snapshot().attn_fwd_kernels == 1
    ref = oracle_with_grads(q, k, v, w, lens)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in leaves)), ref):
        assert_close(got, want, kind, name)
