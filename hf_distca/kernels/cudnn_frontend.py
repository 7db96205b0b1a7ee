"""cuDNN SDPA through NVIDIA's cudnn-frontend (``pip install nvidia-cudnn-frontend``), ragged (THD) layout.

Graphs are built with the frontend's ``pygraph`` API (``sdpa`` / ``sdpa_backward`` nodes on packed
(T, H, D) tensors with per-sequence lengths and ragged offsets) and run on the libcudnn that torch
ships. torch's own cuDNN varlen routes are never used: in torch 2.11 ``aten._cudnn_attention_backward``
with cumulative offsets and nested-jagged SDPA gave wrong gradients.

One kernel call serves many sequences, but one mask alignment. cuDNN's backward is 1.7-1.9x slower
with bottom-right alignment than top-left, so sequences are grouped:

- prefix-aligned sequences (len_q == len_k: whole documents, head shards) run in one top-left causal
  call;
- suffix sequences (len_q < len_k: a query shard over a longer KV prefix) either run in one
  bottom-right causal call (``CudnnOptions.suffix_strategy = "bottom_right"``), or are split
  (``suffix_strategy = "split"``) into a top-left causal part over their last len_q keys, which joins
  the prefix call, and a non-causal part over their earlier len_k - len_q keys, merged through the
  log-sum-exp: out = w1 o1 + w2 o2 with w_i = exp(lse_i - lse), lse = log(exp(lse1) + exp(lse2)). The
  backward of each part takes the merged out and lse, so the parts' dq add up and their dk/dv cover
  disjoint keys.
- sequences without queries run nowhere (the caller zeroes their dk/dv).
- a sliding window W (``PackedSeqs.window``) is cuDNN's ``diagonal_band_left_bound=W`` on the causal
  calls (key j visible from query position i iff i - j < W); suffix sequences then always run
  bottom-right (a split's non-causal part would need the band too).

Forward calls list only their own sequences; ragged offsets address them inside the full packed
tensors, so no rows are copied and calls write disjoint rows of the shared outputs (the non-causal part
of a split writes its partial output to a compact side buffer). Backward calls run on packed operands
(sequences back to back from row 0): cuDNN's ragged backward gave wrong dq otherwise (see
``backward``), so a call whose rows are not already packed gathers them (q, out, dout, lse on the
query side; k, v on the key side) and scatters its gradients back.

Plan cache: a plan is specific to (batch size, max_seqlen_q/k, and for the backward the packed token
totals that size cuDNN's float32 dq accumulator). All of these are rounded up on a ladder of 4 steps
per octave (<= 25% over the real value, never less than 128 tokens) and the batch is padded with
zero-length sequences, so a training run builds a handful of plans per direction instead of one per
step. Measured on H200 (benchmarks/results/kernels_cudnn_h200.md): ~0.36 s for the first call in a
process, ~50 ms per new plan per direction; rounding up cost nothing measurable (grid blocks of padding
sequences and of rows past a sequence's end exit at once). ``CudnnOptions.bucket_shapes = False``
declares exact shapes instead (benchmarks measure what the rounding costs).

The default ``suffix_strategy`` is "split": it measured 1.04-1.05x faster than "bottom_right" on real
server task mixes (one long suffix task among whole documents) and on 4K-query suffix tasks; on short
suffix tasks (1K queries over 2K keys) "bottom_right" was faster (its merge passes weigh less).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from enum import IntEnum

import torch

from hf_distca.kernels.common import ForwardTensors, PackedSeqs

SUFFIX_STRATEGIES = ("bottom_right", "split")
TOP_LEFT, BOTTOM_RIGHT, FULL = "causal_top_left", "causal_bottom_right", "full"


@functools.lru_cache(maxsize=1)
def _cudnn():
    try:
        import cudnn
    except Exception:  # ImportError, or a frontend that cannot load libcudnn
        return None
    return cudnn


def available() -> bool:
    return _cudnn() is not None and torch.cuda.is_available()


@dataclass(frozen=True)
class CudnnOptions:
    """How the cudnn backend runs its calls; the defaults are what training uses, the alternatives are
    there for benchmarks to compare (pass them to :func:`hf_distca.kernels.attention_forward` and
    :func:`~hf_distca.kernels.attention_backward` as ``cudnn_options``)."""

    suffix_strategy: str = "split"
    """How suffix sequences run, one of SUFFIX_STRATEGIES (see the module docstring)."""
    bucket_shapes: bool = True
    """Round plan shapes up (see the module docstring); False declares exact shapes."""

    def __post_init__(self) -> None:
        _check_strategy(self.suffix_strategy)


def _check_strategy(strategy: str) -> None:
    if strategy not in SUFFIX_STRATEGIES:
        raise ValueError(f"suffix_strategy must be one of {SUFFIX_STRATEGIES}, got {strategy!r}")


DEFAULT_OPTIONS = CudnnOptions()


# ---------------------------------------------------------------------------------------------------------
# host-side planning (pure Python: testable without a GPU)


@dataclass(frozen=True)
class KernelCall:
    """One cuDNN launch over several sequences with one mask. Row offsets index the packed tensors."""

    mask: str
    """TOP_LEFT, BOTTOM_RIGHT or FULL (non-causal)."""
    q_rows: tuple[int, ...]
    """First query row of each sequence in q (also where its out/dout/lse rows are in the backward)."""
    k_rows: tuple[int, ...]
    """First key row of each sequence in k and v (and dk, dv)."""
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    out_rows: tuple[int, ...]
    """First row of each sequence's partial output (forward out/lse, backward dq) in the call's target
    buffer: the shared output (== q_rows) or a compact side buffer."""
    side: bool
    """Whether the call writes out/lse (forward) and dq (backward) to compact side buffers."""
    window: int | None = None
    """Sliding window of the causal masks (None: full causal)."""

    @property
    def num_seqs(self) -> int:
        return len(self.q_rows)


def plan_calls(seqs: PackedSeqs, strategy: str) -> tuple[KernelCall, ...]:
    """Group the sequences of one kernel call by mask alignment (see the module docstring).

    Calls come in the order they must run: the top-left call, then the bottom-right one, then the
    non-causal side call of a split (its backward adds onto the dq the top-left call wrote).
    """
    _check_strategy(strategy)
    prefix: list[tuple[int, int, int, int, int]] = []  # (q_row, k_row, lq, lk, out_row)
    suffix: list[tuple[int, int, int, int, int]] = []
    rest: list[tuple[int, int, int, int, int]] = []  # split: non-causal parts, out rows in the side buffer
    side_rows = 0
    for i in range(seqs.num_seqs):
        q0, k0, lq, lk = seqs.q_bounds[i], seqs.k_bounds[i], seqs.q_len(i), seqs.k_len(i)
        if lq == 0:
            continue
        if lq == lk:
            prefix.append((q0, k0, lq, lk, q0))
        elif strategy == "bottom_right" or seqs.window is not None:
            suffix.append((q0, k0, lq, lk, q0))
        else:
            prefix.append((q0, k0 + lk - lq, lq, lq, q0))  # causal square over the last lq keys
            rest.append((q0, k0, lq, lk - lq, side_rows))  # every query sees every earlier key
            side_rows += lq

    def call(mask: str, rows: list[tuple[int, int, int, int, int]], side: bool) -> KernelCall:
        q_rows, k_rows, q_lens, k_lens, out_rows = (tuple(col) for col in zip(*rows))
        return KernelCall(mask, q_rows, k_rows, q_lens, k_lens, out_rows, side, seqs.window)

    calls = []
    if prefix:
        calls.append(call(TOP_LEFT, prefix, False))
    if suffix:
        calls.append(call(BOTTOM_RIGHT, suffix, False))
    if rest:
        calls.append(call(FULL, rest, True))
    return tuple(calls)


def packed_starts(lengths: tuple[int, ...]) -> tuple[int, ...]:
    """Start rows of sequences of these lengths laid out back to back from row 0."""
    starts, row = [], 0
    for n in lengths:
        starts.append(row)
        row += n
    return tuple(starts)


def bucket(n: int, minimum: int) -> int:
    """Round up on a ladder with 4 steps per octave (<= 25% over n), never below ``minimum``."""
    if n <= minimum:
        return minimum
    step = max(1, (1 << (n.bit_length() - 1)) // 4)
    return -(-n // step) * step


# ---------------------------------------------------------------------------------------------------------
# cuDNN graphs


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
    if torch.cuda.is_available():
        lens, offsets = lens.pin_memory(), offsets.pin_memory()
    lens = lens.to(device, non_blocking=True)
    offsets = offsets.to(device, non_blocking=True)
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


def _aligned(t: torch.Tensor) -> torch.Tensor:
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
        seq, pos, row = (t.to(q.device, non_blocking=True) for t in (seq, pos, row))
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


# ---------------------------------------------------------------------------------------------------------
# the backend interface


def _row_index(starts: tuple[int, ...], lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """(sum(lengths),) int64 on ``device``: the rows of sequences at these starts, in order."""
    lens = torch.tensor(lengths, dtype=torch.int64)
    shift = torch.tensor(starts, dtype=torch.int64) - (torch.cumsum(lens, 0) - lens)  # start - packed start
    rows = torch.arange(int(lens.sum()), dtype=torch.int64) + torch.repeat_interleave(shift, lens)
    if device.type == "cuda":
        rows = rows.pin_memory()
    return rows.to(device, non_blocking=True)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqs: PackedSeqs,
    scale: float,
    options: CudnnOptions = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = _aligned(q), _aligned(k), _aligned(v)
    out = torch.empty_like(q)  # (Tq, Hq, D); every query row belongs to exactly one non-side call
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)  # (Tq, Hq)
    bucket_shapes = options.bucket_shapes
    for call in plan_calls(seqs, options.suffix_strategy):
        if not call.side:
            launch_forward(call, q, k, v, out, lse, scale, bucket_shapes=bucket_shapes)
            continue
        # split suffix sequences: the top-left call wrote their causal part; merge the non-causal part
        rows = sum(call.q_lens)
        side_out = q.new_empty(rows, *q.shape[1:])  # (rows, Hq, D)
        side_lse = lse.new_empty(rows, q.shape[1])  # (rows, Hq)
        launch_forward(call, q, k, v, side_out, side_lse, scale, bucket_shapes=bucket_shapes)
        if call.q_rows == packed_starts(call.q_lens):  # the side rows are q's first rows: no gather
            main_out, main_lse = out[:rows], lse[:rows]
        else:
            index = _row_index(call.q_rows, call.q_lens, q.device)
            main_out, main_lse = out.index_select(0, index), lse.index_select(0, index)
        merged_lse = torch.logaddexp(main_lse, side_lse)  # (rows, Hq)
        side_weight = torch.exp(side_lse - merged_lse).unsqueeze(-1)  # (rows, Hq, 1)
        merged_out = torch.lerp(main_out.float(), side_out.float(), side_weight).to(q.dtype)  # (rows, Hq, D)
        if call.q_rows == packed_starts(call.q_lens):
            out[:rows], lse[:rows] = merged_out, merged_lse
        else:
            out.index_copy_(0, index, merged_out)
            lse.index_copy_(0, index, merged_lse)
    return out, lse


def backward(
    dout: torch.Tensor,
    fwd: ForwardTensors,
    seqs: PackedSeqs,
    scale: float,
    options: CudnnOptions = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every call's backward on packed operands.

    cuDNN's ragged backward computed wrong dq (about 1% of entries, wrong by O(1)) on H200 / cuDNN 9.19
    when a call's sequences did not lie back to back from row 0 (gaps, or a later start; the forward is
    unaffected): so every backward launch gets its query side (q, out, dout, lse, dq) and key side (k, v,
    dk, dv) packed, gathering the rows of calls that are not already packed.
    """
    q, k, v, out, lse = fwd
    dout, q, k, v, out = (_aligned(t) for t in (dout, q, k, v, out))
    lse = _aligned(lse.float())
    dq = torch.empty_like(q)  # every query row is written by exactly one non-side call
    dk = torch.zeros_like(k)  # keys of sequences without queries are written by no call
    dv = torch.zeros_like(v)
    for call in plan_calls(seqs, options.suffix_strategy):
        q_starts, k_starts = packed_starts(call.q_lens), packed_starts(call.k_lens)
        packed = KernelCall(
            call.mask, q_starts, k_starts, call.q_lens, call.k_lens, q_starts, call.side, call.window
        )
        q_in_place = call.q_rows == q_starts
        k_in_place = call.k_rows == k_starts
        rows = sum(call.q_lens)
        if q_in_place:
            q_c, out_c, dout_c, lse_c = q, out, dout, lse
        else:
            q_index = _row_index(call.q_rows, call.q_lens, q.device)
            q_c, out_c, dout_c, lse_c = (
                t.index_select(0, q_index) for t in (q, out, dout, lse)
            )  # (rows, ...)
        if k_in_place:
            k_c, v_c, dk_c, dv_c = k, v, dk, dv
        else:
            k_index = _row_index(call.k_rows, call.k_lens, k.device)
            k_c, v_c = k.index_select(0, k_index), v.index_select(0, k_index)  # (keys, Hkv, D)
            dk_c, dv_c = torch.empty_like(k_c), torch.empty_like(v_c)
        dq_c = dq if q_in_place and not call.side else q.new_empty(rows, *q.shape[1:])  # (rows, Hq, D)
        fwd_c = ForwardTensors(q_c, k_c, v_c, out_c, lse_c)
        launch_backward(packed, dout_c, fwd_c, (dq_c, dk_c, dv_c), scale, bucket_shapes=options.bucket_shapes)
        if call.side:  # the non-causal part of split sequences: add onto the causal part's dq
            if q_in_place:
                dq[:rows] += dq_c
            else:
                dq.index_add_(0, q_index, dq_c)
        elif not q_in_place:
            dq.index_copy_(0, q_index, dq_c)
        if not k_in_place:
            dk.index_copy_(0, k_index, dk_c)
            dv.index_copy_(0, k_index, dv_c)
    return dq, dk, dv
