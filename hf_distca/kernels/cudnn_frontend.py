"""cuDNN SDPA through NVIDIA's cudnn-frontend (``pip install nvidia-cudnn-frontend``), ragged (THD) layout:
the graphs, their cache and the launches of :class:`~hf_distca.kernels.cudnn_calls.KernelCall` s; the
backend that plans and merges the calls is :mod:`hf_distca.kernels.cudnn_backend`.

Graphs are built with the frontend's ``pygraph`` API (``sdpa`` / ``sdpa_backward`` nodes on packed
(T, H, D) tensors with per-sequence lengths and ragged offsets) and run on the libcudnn that torch
ships. torch's own cuDNN varlen routes are never used: in torch 2.11 ``aten._cudnn_attention_backward``
with cumulative offsets and nested-jagged SDPA gave wrong gradients.

Plan cache: a plan is specific to (batch size, max_seqlen_q/k, and for the backward the packed token
totals that size cuDNN's float32 dq accumulator). All of these are rounded up on a ladder of 4 steps
per octave (<= 25% over the real value, never less than 128 tokens) and the batch is padded with
zero-length sequences, so a training run builds a handful of plans per direction instead of one per
step. Measured on H200 (benchmarks/results/kernels_cudnn_h200.md): ~0.36 s for the first call in a
process, ~50 ms per new plan per direction; rounding up cost nothing measurable (grid blocks of padding
sequences and of rows past a sequence's end exit at once). ``CudnnOptions.bucket_shapes = False``
declares exact shapes instead (benchmarks measure what the rounding costs).
"""

from __future__ import annotations

import functools
import threading
from enum import IntEnum

import torch

from hf_distca.kernels.common import ForwardTensors, host_to_device
from hf_distca.kernels.cudnn_calls import FULL, TOP_LEFT, KernelCall, bucket


@functools.lru_cache(maxsize=1)
def _cudnn():
    try:
        import cudnn
    except Exception:  # ImportError, or a frontend that cannot load libcudnn
        return None
    return cudnn


def available() -> bool:
    return _cudnn() is not None and torch.cuda.is_available()


class _UID(IntEnum):
    Q = 1
    K = 2
    V = 3
    O = 4  # noqa: E741
    STATS = 5
    DO = 6
    DQ = 7
    DK = 8
    DV = 9
    SEQ_LEN_Q = 10
    SEQ_LEN_KV = 11
    RAGGED_Q = 12
    RAGGED_K = 13
    RAGGED_V = 14
    RAGGED_O = 15
    RAGGED_STATS = 16
    RAGGED_DQ = 17
    RAGGED_DK = 18
    RAGGED_DV = 19


_MIN_SEQLEN = 128
_graphs: dict[tuple, tuple] = {}
_graphs_lock = threading.Lock()
_handles = threading.local()
plan_builds = {"forward": 0, "backward": 0}
"""Plans built in this process per direction (the benchmark reports them)."""
ragged_backward_stats: bool | None = None
"""Whether the backward reads the log-sum-exp packed (T, H) with ragged offsets (None: not tried yet);
False after cuDNN refused it once: the backward then gets it padded to (B, H, max_seqlen_q)."""


def _handle(device: torch.device):
    cudnn = _cudnn()
    handles = getattr(_handles, "by_device", None)
    if handles is None:
        handles = _handles.by_device = {}
    if device not in handles:
        with torch.cuda.device(device):
            handles[device] = cudnn.create_handle()
    cudnn.set_stream(handle=handles[device], stream=torch.cuda.current_stream(device).cuda_stream)
    return handles[device]


def _thd_stride(seqlen: int, heads: int, dim: int) -> list[int]:
    """(B, H, S, D) descriptor strides of a packed (T, H, D) tensor; the batch stride is a placeholder
    (ragged offsets give each sequence's base)."""
    return [seqlen * heads * dim, dim, heads * dim, 1]


def _mask_arguments(cudnn, mask: str, window: int | None) -> dict:
    if mask == FULL:
        return {"diagonal_alignment": cudnn.diagonal_alignment.TOP_LEFT}
    alignment = (
        cudnn.diagonal_alignment.TOP_LEFT if mask == TOP_LEFT else cudnn.diagonal_alignment.BOTTOM_RIGHT
    )
    args = {"diagonal_alignment": alignment, "diagonal_band_right_bound": 0}
    if window is not None:
        args["diagonal_band_left_bound"] = window  # keys j with i - j < window (the window length)
    return args


def _new_graph(cudnn, handle, dtype: torch.dtype):
    io = cudnn.data_type.BFLOAT16 if dtype == torch.bfloat16 else cudnn.data_type.HALF
    graph = cudnn.pygraph(
        handle=handle,
        io_data_type=io,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
    )
    return graph, io


def _column(graph, cudnn, name: str, rows: int, uid: int, dtype):
    return graph.tensor(name=name, dim=[rows, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dtype, uid=uid)


def _finish(graph) -> int:
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([_cudnn().heur_mode.A, _cudnn().heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return graph.get_workspace_size()


def _sdpa_arguments(g, cudnn, io, dims: tuple[int, ...], scale: float, mask: str, window: int | None) -> dict:
    """What the forward and backward sdpa nodes share: q (B, Hq, S_q, D), k and v (B, Hkv, S_kv, D) as ragged
    views of packed (T, H, D) tensors, the per-sequence lengths, the scale and the mask."""
    b, hq, hk, d, s_q, s_kv = dims
    i64, i32 = cudnn.data_type.INT64, cudnn.data_type.INT32
    operands = {}
    for name, uid, ragged, heads, seqlen in (
        ("q", _UID.Q, _UID.RAGGED_Q, hq, s_q),
        ("k", _UID.K, _UID.RAGGED_K, hk, s_kv),
        ("v", _UID.V, _UID.RAGGED_V, hk, s_kv),
    ):
        t = g.tensor(
            name=name, dim=[b, heads, seqlen, d], stride=_thd_stride(seqlen, heads, d), data_type=io, uid=uid
        )
        t.set_ragged_offset(_column(g, cudnn, f"ragged_{name}", b + 1, ragged, i64))
        operands[name] = t
    operands["seq_len_q"] = _column(g, cudnn, "seq_len_q", b, _UID.SEQ_LEN_Q, i32)
    operands["seq_len_kv"] = _column(g, cudnn, "seq_len_kv", b, _UID.SEQ_LEN_KV, i32)
    return {**operands, "attn_scale": scale, "use_padding_mask": True, **_mask_arguments(cudnn, mask, window)}


def _forward_graph(key: tuple, handle):
    cudnn = _cudnn()
    dtype, b, hq, hk, d, s_q, s_kv, mask, scale, window = key[1:11]
    g, io = _new_graph(cudnn, handle, dtype)
    i64 = cudnn.data_type.INT64
    shared = _sdpa_arguments(g, cudnn, io, (b, hq, hk, d, s_q, s_kv), scale, mask, window)
    o, stats = g.sdpa(name="sdpa_fwd", generate_stats=True, **shared)
    o.set_uid(_UID.O).set_output(True).set_dim([b, hq, s_q, d]).set_stride(_thd_stride(s_q, hq, d))
    o.set_data_type(io)
    o.set_ragged_offset(_column(g, cudnn, "ragged_o", b + 1, _UID.RAGGED_O, i64))
    stats.set_uid(_UID.STATS).set_output(True).set_dim([b, hq, s_q, 1]).set_stride(_thd_stride(s_q, hq, 1))
    stats.set_data_type(cudnn.data_type.FLOAT)
    stats.set_ragged_offset(_column(g, cudnn, "ragged_stats", b + 1, _UID.RAGGED_STATS, i64))
    workspace = _finish(g)
    plan_builds["forward"] += 1
    return g, workspace


def _backward_graph(key: tuple, handle, ragged_stats: bool):
    cudnn = _cudnn()
    dtype, b, hq, hk, d, s_q, s_kv, mask, scale, total_q, total_kv, window = key[1:13]
    g, io = _new_graph(cudnn, handle, dtype)
    i64 = cudnn.data_type.INT64
    q_stride, kv_stride = _thd_stride(s_q, hq, d), _thd_stride(s_kv, hk, d)
    shared = _sdpa_arguments(g, cudnn, io, (b, hq, hk, d, s_q, s_kv), scale, mask, window)
    o = g.tensor(name="o", dim=[b, hq, s_q, d], stride=q_stride, data_type=io, uid=_UID.O)
    do = g.tensor(name="dO", dim=[b, hq, s_q, d], stride=q_stride, data_type=io, uid=_UID.DO)
    ragged_o = _column(g, cudnn, "ragged_o", b + 1, _UID.RAGGED_O, i64)
    o.set_ragged_offset(ragged_o)
    do.set_ragged_offset(ragged_o)
    # the log-sum-exp: packed (T, H) with ragged offsets, or padded (B, H, S_q, 1)
    stats_stride = _thd_stride(s_q, hq, 1) if ragged_stats else [hq * s_q, s_q, 1, 1]
    stats = g.tensor(
        name="stats",
        dim=[b, hq, s_q, 1],
        stride=stats_stride,
        data_type=cudnn.data_type.FLOAT,
        uid=_UID.STATS,
    )
    if ragged_stats:
        stats.set_ragged_offset(_column(g, cudnn, "ragged_stats", b + 1, _UID.RAGGED_STATS, i64))
    dq, dk, dv = g.sdpa_backward(
        name="sdpa_bwd",
        o=o,
        dO=do,
        stats=stats,
        max_total_seq_len_q=total_q,
        max_total_seq_len_kv=total_kv,
        use_deterministic_algorithm=False,
        **shared,
    )
    for t, uid, dims, stride, ragged in (
        (dq, _UID.DQ, [b, hq, s_q, d], q_stride, _UID.RAGGED_DQ),
        (dk, _UID.DK, [b, hk, s_kv, d], kv_stride, _UID.RAGGED_DK),
        (dv, _UID.DV, [b, hk, s_kv, d], kv_stride, _UID.RAGGED_DV),
    ):
        t.set_uid(uid).set_output(True).set_dim(dims).set_stride(stride).set_data_type(io)
        t.set_ragged_offset(_column(g, cudnn, f"ragged_{int(uid)}", b + 1, ragged, i64))
    workspace = _finish(g)
    plan_builds["backward"] += 1
    return g, workspace


def _cached_backward_graph(key: tuple, handle):
    """The backward plan; tries the packed log-sum-exp layout once and remembers if cuDNN refuses it."""
    global ragged_backward_stats
    for ragged in (True, False):
        if ragged and ragged_backward_stats is False:
            continue
        full_key = (*key, ragged)
        hit = _graphs.get(full_key)
        if hit is not None:
            return hit, ragged
        with _graphs_lock:
            try:
                hit = _graphs.setdefault(full_key, _backward_graph(key, handle, ragged))
            except Exception:
                if not ragged:
                    raise
                ragged_backward_stats = False
                continue
        if ragged:
            ragged_backward_stats = True
        return hit, ragged
    raise AssertionError("unreachable: the padded layout either builds or raises")


def _cached_forward_graph(key: tuple, handle):
    hit = _graphs.get(key)
    if hit is None:
        with _graphs_lock:
            hit = _graphs.get(key)
            if hit is None:
                hit = _graphs[key] = _forward_graph(key, handle)
    return hit


def _metadata(call: KernelCall, b: int, hq: int, hk: int, d: int, device: torch.device):
    """Device tensors: seq_len_q, seq_len_kv (B, 1, 1, 1) int32, then the ragged element offsets
    (B + 1, 1, 1, 1) int64 of q, k, out (at out rows), stats at out rows and stats at query rows."""
    # entries past num_seqs are zero-length sequences padding the batch to its bucket b;
    # one host buffer per dtype, one copy each; row pitches keep every column 16-byte aligned
    lens = torch.zeros(2, -(-b // 4) * 4, dtype=torch.int32)
    lens[0, : call.num_seqs] = torch.tensor(call.q_lens, dtype=torch.int32)
    lens[1, : call.num_seqs] = torch.tensor(call.k_lens, dtype=torch.int32)
    # offsets stay non-decreasing like cumulative offsets with gaps: the end entry and the padding
    # sequences sit where the last sequence ends
    rows = torch.tensor(
        [
            [*call.q_rows, call.q_rows[-1] + call.q_lens[-1]],
            [*call.k_rows, call.k_rows[-1] + call.k_lens[-1]],
            [*call.out_rows, call.out_rows[-1] + call.q_lens[-1]],
        ],
        dtype=torch.int64,
    )  # (3, N + 1)
    elements = torch.tensor([[hq * d], [hk * d], [hq * d], [hq], [hq]], dtype=torch.int64)
    offsets = (rows[[0, 1, 2, 2, 0]] * elements)[:, -1:].repeat(1, -(-(b + 1) // 2) * 2)  # (5, pitch)
    offsets[:, : call.num_seqs + 1] = rows[[0, 1, 2, 2, 0]] * elements
    lens, offsets = host_to_device(lens, device), host_to_device(offsets, device)  # pinned: no host wait
    return (
        *(lens[i, :b].view(b, 1, 1, 1) for i in range(2)),
        *(offsets[i, : b + 1].view(b + 1, 1, 1, 1) for i in range(5)),
    )


def _plan_size(n: int, minimum: int, bucket_shapes: bool) -> int:
    """The size a plan declares for n: bucketed (see :func:`bucket`), or exact (at least 1)."""
    return bucket(n, minimum) if bucket_shapes else max(n, 1)


def _batch_and_lengths(call: KernelCall, bucket_shapes: bool) -> tuple[int, int, int]:
    return (
        _plan_size(call.num_seqs, 1, bucket_shapes),
        _plan_size(max(call.q_lens), _MIN_SEQLEN, bucket_shapes),
        _plan_size(max(call.k_lens), _MIN_SEQLEN, bucket_shapes),
    )


def aligned(t: torch.Tensor) -> torch.Tensor:
    """cuDNN descriptors need a dense innermost dimension and a 16-byte aligned base."""
    if not t.is_contiguous() or t.data_ptr() % 16:
        t = t.contiguous().clone()
    return t


def _execute(graph, workspace_size: int, handle, buffers: dict, device: torch.device) -> None:
    """Run a built graph on ``buffers`` (uid -> tensor) with a fresh workspace."""
    workspace = torch.empty(max(workspace_size, 1), dtype=torch.uint8, device=device)
    graph.execute(list(buffers.values()), workspace, handle=handle, tensor_uids=[int(u) for u in buffers])


def launch_forward(
    call: KernelCall,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    *,
    bucket_shapes: bool = True,
) -> None:
    """Write this call's sequences' output and log-sum-exp rows (at call.out_rows) into out and lse.
    ``bucket_shapes``: as :attr:`CudnnOptions.bucket_shapes`."""
    hq, hk, d = q.shape[1], k.shape[1], q.shape[2]
    b, s_q, s_kv = _batch_and_lengths(call, bucket_shapes)
    handle = _handle(q.device)
    key = ("forward", q.dtype, b, hq, hk, d, s_q, s_kv, call.mask, float(scale), call.window, q.device)
    graph, workspace_size = _cached_forward_graph(key, handle)
    len_q, len_kv, off_q, off_k, off_o, off_stats, _ = _metadata(call, b, hq, hk, d, q.device)
    buffers = {
        _UID.Q: q,
        _UID.K: k,
        _UID.V: v,
        _UID.O: out,
        _UID.STATS: lse,
        _UID.SEQ_LEN_Q: len_q,
        _UID.SEQ_LEN_KV: len_kv,
        _UID.RAGGED_Q: off_q,
        _UID.RAGGED_K: off_k,
        _UID.RAGGED_V: off_k,
        _UID.RAGGED_O: off_o,
        _UID.RAGGED_STATS: off_stats,
    }
    _execute(graph, workspace_size, handle, buffers, q.device)


def launch_backward(
    call: KernelCall,
    dout: torch.Tensor,
    fwd: ForwardTensors,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
    *,
    bucket_shapes: bool = True,
) -> None:
    """Write this call's dq rows (at call.out_rows) into dq and its keys' rows into dk and dv
    (``grads`` = (dq, dk, dv), shaped like q, k, v).

    fwd's out and lse are the final (merged) forward results at the query rows: every part of a split
    sequence differentiates against them. ``bucket_shapes``: as :attr:`CudnnOptions.bucket_shapes`."""
    q, k, v, out, lse = fwd
    dq, dk, dv = grads
    hq, hk, d = q.shape[1], k.shape[1], q.shape[2]
    b, s_q, s_kv = _batch_and_lengths(call, bucket_shapes)
    totals = (
        _plan_size(max(q.shape[0], dq.shape[0]), _MIN_SEQLEN, bucket_shapes),
        _plan_size(k.shape[0], _MIN_SEQLEN, bucket_shapes),
    )
    handle = _handle(q.device)
    key = (
        "backward",
        q.dtype,
        b,
        hq,
        hk,
        d,
        s_q,
        s_kv,
        call.mask,
        float(scale),
        *totals,
        call.window,
        q.device,
    )
    (graph, workspace_size), ragged = _cached_backward_graph(key, handle)
    len_q, len_kv, off_q, off_k, off_dq, _, off_stats = _metadata(call, b, hq, hk, d, q.device)
    if ragged:
        stats = lse
    else:  # padded (B, Hq, S_q): sequence j's row r at [j, :, r]
        seq = torch.repeat_interleave(torch.arange(call.num_seqs), torch.tensor(call.q_lens))
        pos = torch.cat([torch.arange(n) for n in call.q_lens])
        row = torch.tensor(call.q_rows)[seq] + pos
        seq, pos, row = (host_to_device(t, q.device) for t in (seq, pos, row))  # pinned: no host wait
        stats = torch.zeros(b, hq, s_q, dtype=torch.float32, device=q.device)
        stats[seq, :, pos] = lse[row]
    buffers = {
        _UID.Q: q,
        _UID.K: k,
        _UID.V: v,
        _UID.O: out,
        _UID.DO: dout,
        _UID.STATS: stats,
        _UID.DQ: dq,
        _UID.DK: dk,
        _UID.DV: dv,
        _UID.SEQ_LEN_Q: len_q,
        _UID.SEQ_LEN_KV: len_kv,
        _UID.RAGGED_Q: off_q,
        _UID.RAGGED_O: off_q,
        _UID.RAGGED_DQ: off_dq,
        _UID.RAGGED_K: off_k,
        _UID.RAGGED_V: off_k,
        _UID.RAGGED_DK: off_k,
        _UID.RAGGED_DV: off_k,
    }
    if ragged:
        buffers[_UID.RAGGED_STATS] = off_stats
    _execute(graph, workspace_size, handle, buffers, q.device)
