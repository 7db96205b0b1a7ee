"""Index and offset arithmetic past 2**31 elements, checked on the CPU without allocating 2**31 elements.

At 512K tokens of 32 query heads x 128 (Llama-3-8B's attention) q and the attention output hold more than 2**31
elements: every ELEMENT offset (rows x heads x head_dim) must be int64. Row offsets (``cu_seqlens``, in tokens)
stay int32, as the varlen kernels take them, and are refused rather than wrapped past 2**31 - 1 rows. The same
sizes on a GPU, with real tensors: tests/test_gpu_large_index.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_distca.kernels.common import INT32_MAX, VarlenOffsets, check_inputs, int32_offsets
from hf_distca.kernels.cudnn_backend import _row_index
from hf_distca.kernels.cudnn_calls import TOP_LEFT, KernelCall
from hf_distca.kernels.cudnn_frontend import _metadata
from hf_distca.planning import build_dispatch_index, plan_core_attention

HQ, HKV, D = 32, 8, 128
DOC, DOCS = 8448, 64
TOKENS = DOC * DOCS  # 540672 rows: q holds 2.2e9 elements
BEYOND = 2**31 // (HQ * D)  # the first row of q whose elements start past 2**31


def test_the_sizes_are_past_2_31_elements():
    assert TOKENS * HQ * D > 2**31 > BEYOND * HQ * D - 1 and BEYOND < TOKENS


def _rows(n: int) -> torch.Tensor:
    """A (n, 1, 1) tensor of n rows without n elements of memory (stride 0)."""
    return torch.zeros(1, 1, 1).expand(n, 1, 1)


def test_int32_offsets_refuse_rows_past_2_31_instead_of_wrapping():
    """torch.as_tensor(int64 offsets, dtype=torch.int32) (what the engine did) wraps 2**31 to -2**31."""
    ok = int32_offsets(np.array([0, 5, INT32_MAX], dtype=np.int64))
    assert ok.dtype == torch.int32 and ok.tolist() == [0, 5, INT32_MAX]
    assert int32_offsets([0, 3]).tolist() == [0, 3]
    for bad in (
        np.array([0, 2**31], dtype=np.int64),
        [0, 2**31 + 5],
        torch.tensor([0, 2**32], dtype=torch.int64),
    ):
        with pytest.raises(ValueError, match="int32"):
            int32_offsets(bad)


def test_kernel_inputs_past_2_31_rows_are_refused_not_wrapped():
    """cu_seqlens in int64 reaching 2**31 rows would be wrapped by the backends' int32 conversion
    (``device_offsets``): check_inputs refuses them, naming the limit (the tensor has 2**31 rows but no memory)."""
    rows = 2**31 + 256
    q = _rows(rows)
    cu = torch.tensor([0, 256, rows], dtype=torch.int64)
    with pytest.raises(ValueError, match="int32"):
        check_inputs(q, q, q, VarlenOffsets(cu, cu, rows - 256, rows - 256))
    # 540672 rows (2.2e9 elements of 32 x 128) are far from it
    big = torch.zeros(1, 1, 1).expand(TOKENS, HQ, D)
    cu = torch.arange(DOCS + 1, dtype=torch.int64) * DOC
    seqs = check_inputs(big, big, big, VarlenOffsets(cu, cu, DOC, DOC))
    assert seqs.q_bounds[-1] == TOKENS


def test_cudnn_ragged_offsets_are_int64_element_offsets_past_2_31():
    """cuDNN's ragged offsets count ELEMENTS: rows x heads x head_dim, past 2**31 for the last documents."""
    starts = (0, BEYOND - DOC // 2, TOKENS - DOC)  # one before, one across, one past element 2**31
    call = KernelCall(TOP_LEFT, starts, starts, (DOC,) * 3, (DOC,) * 3, starts, False)
    len_q, len_kv, off_q, off_k, off_o, off_stats_out, off_stats_q = _metadata(
        call, 3, HQ, HKV, D, torch.device("cpu")
    )
    assert len_q.dtype == torch.int32 and len_q.flatten().tolist() == [DOC] * 3
    ends = (*starts, TOKENS)
    for got, per_row in (
        (off_q, HQ * D),
        (off_k, HKV * D),
        (off_o, HQ * D),
        (off_stats_out, HQ),
        (off_stats_q, HQ),
    ):
        assert got.dtype == torch.int64
        assert got.flatten().tolist() == [r * per_row for r in ends]
    assert off_q.flatten()[-1] == TOKENS * HQ * D > 2**31


def test_cudnn_row_gathers_are_int64_past_2_31_elements():
    rows = _row_index((BEYOND - 3, TOKENS - 2), (5, 2), torch.device("cpu"))
    assert rows.dtype == torch.int64
    assert rows.tolist() == [BEYOND - 3 + i for i in range(5)] + [TOKENS - 2, TOKENS - 1]
    assert int((rows * (HQ * D)).max()) == (TOKENS - 1) * HQ * D  # element offsets in the index dtype


@pytest.mark.parametrize("world", [1, 2])
def test_dispatch_index_arrays_are_int64_so_element_offsets_do_not_wrap(world):
    """Every row index of a 528K-token micro-batch is int64: row x heads x head_dim computed in the arrays'
    own dtype (as a gather over flattened rows would) is the exact element offset past 2**31."""
    per_rank = TOKENS // world
    docs_per_rank = DOCS // world
    # documents in reverse order inside each rank, so the gathers move rows across element 2**31
    pieces = [
        [(d, 0, DOC) for d in reversed(range(r * docs_per_rank, (r + 1) * docs_per_rank))]
        for r in range(world)
    ]
    plan = plan_core_attention(pieces, q_row_bytes=HQ * D * 2, kv_row_bytes=2 * HKV * D * 2)
    for rank in range(world):
        index = build_dispatch_index(plan, rank)
        assert index.num_local == per_rank
        arrays = {
            name: getattr(index, name)
            for name in (
                "send_q_rows",
                "send_kv_rows",
                "kernel_q_index",
                "kernel_kv_index",
                "out_send_index",
                "out_gather",
                "computed_rows",
                "cu_seqlens_q",
                "cu_seqlens_k",
            )
        }
        for name, a in arrays.items():
            assert a.dtype == np.int64, (name, a.dtype)
        pool_rows = index.kernel_q_index  # into cat([local rows, received rows])
        assert sorted(pool_rows.tolist()) == sorted(set(pool_rows.tolist()))
        elements = pool_rows * (HQ * D)
        assert int(elements.max()) == int(pool_rows.max()) * HQ * D
        if world == 1:
            assert int(elements.max()) > 2**31  # the last rows' elements start past 2**31
            # one rank: documents ascending in the kernel, gathered from the reversed local order
            assert pool_rows[:DOC].tolist() == list(range(TOKENS - DOC, TOKENS))
            assert index.out_gather[-DOC:].tolist() == list(range(DOC))


def test_one_rank_engine_gathers_split_documents_across_element_2_31():
    """The layout of tests/test_gpu_large_index.py's engine test, planned on the CPU (stride-0 tensors: no
    memory): each document's two halves lie far apart in local rows (first halves in reverse document order,
    then second halves), and the server kernel gets every document whole, in order, gathered by int64 rows."""
    from hf_distca import DistCAConfig
    from hf_distca.engine import EngineState, prepare

    half = DOC // 2
    pieces = [(d, 0, half) for d in reversed(range(DOCS))] + [(d, half, half) for d in range(DOCS)]
    q, k = torch.zeros(1, 1, 1).expand(TOKENS, HQ, D), torch.zeros(1, 1, 1).expand(TOKENS, HKV, D)
    prepared = prepare(q, k, k, pieces, config=DistCAConfig(cost_table=None), state=EngineState())
    want = np.concatenate([
        np.r_[np.arange((DOCS - 1 - d) * half, (DOCS - d) * half), np.arange((DOCS + d) * half, (DOCS + d + 1) * half)]
        for d in range(DOCS)
    ])  # fmt: skip
    index = prepared.index
    assert not prepared.communicates
    assert prepared.cu_seqlens_q.dtype == torch.int32
    assert prepared.cu_seqlens_q.tolist() == prepared.cu_seqlens_k.tolist() == list(range(0, TOKENS + 1, DOC))
    assert index.kernel_q_index.dtype == index.kernel_kv_index.dtype == index.out_gather.dtype == np.int64
    assert np.array_equal(index.kernel_q_index, want) and np.array_equal(index.kernel_kv_index, want)
    assert np.array_equal(want[index.out_gather], np.arange(TOKENS))  # outputs come back to their rows
    assert int(index.kernel_q_index.max()) * HQ * D > 2**31


def test_torch_varlen_refuses_tensors_past_2_31_elements():
    """torch's varlen kernel wrote non-finite outputs for q past 2**31 elements on an H200: refused before
    the kernel, naming the backend that is exact there (meta tensors: nothing allocated)."""
    from hf_distca.kernels import torch_varlen

    rows = 2**31 // (32 * 128) + 1  # q of (rows, 32, 128): just past 2**31 elements
    q = torch.empty(rows, 32, 128, device="meta", dtype=torch.bfloat16)
    k = torch.empty(rows, 8, 128, device="meta", dtype=torch.bfloat16)
    with pytest.raises(
        ValueError, match=r"backend 'torch_varlen': q of this call hold \d+ elements.*'cudnn'"
    ):
        torch_varlen.check_elements(q, k)
    torch_varlen.check_elements(q[:-2], k[:-2])  # 2**31 - 4096 elements: accepted
    with pytest.raises(ValueError, match="backend 'torch_varlen'"):
        torch_varlen.forward(q, k, k, None, 1.0)  # refused before anything reads the sequences
    with pytest.raises(ValueError, match="backend 'torch_varlen'"):
        torch_varlen.backward(q, (q, k, k, q, None), None, 1.0)
