"""The cudnn kernel backend: :func:`forward` and :func:`backward` over packed sequences, as cuDNN SDPA
launches (:mod:`hf_distca.kernels.cudnn_frontend`) of the calls :func:`~hf_distca.kernels.cudnn_calls.plan_calls`
groups.

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
``backward``), so a call whose rows are not one aligned run (then it reads and writes views from its
first row) gathers them (q, out, dout, lse on the query side; k, v on the key side) and scatters its
gradients back. A backward call over more than ``CudnnOptions.backward_rows`` rows runs as several
launches over whole sequences: cuDNN's backward workspace grows with the rows of a launch (float32
accumulators, about 3 x rows x Hq x D: 24 GiB at 512K rows of 32 x 128 heads).

The default ``suffix_strategy`` is "split": it measured 1.04-1.05x faster than "bottom_right" on real
server task mixes (one long suffix task among whole documents) and on 4K-query suffix tasks; on short
suffix tasks (1K queries over 2K keys) "bottom_right" was faster (its merge passes weigh less).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_distca.kernels.common import ForwardTensors, PackedSeqs, host_to_device
from hf_distca.kernels.cudnn_calls import KernelCall, check_strategy, packed_starts, plan_calls, split_call
from hf_distca.kernels.cudnn_frontend import aligned, launch_backward, launch_forward

__all__ = ["DEFAULT_OPTIONS", "CudnnOptions", "backward", "forward"]


@dataclass(frozen=True)
class CudnnOptions:
    """How the cudnn backend runs its calls; the defaults are what training uses, the alternatives are
    there for benchmarks to compare (pass them to :func:`hf_distca.kernels.attention_forward` and
    :func:`~hf_distca.kernels.attention_backward` as ``cudnn_options``)."""

    suffix_strategy: str = "split"
    """How suffix sequences run, one of SUFFIX_STRATEGIES (see the module docstring)."""
    bucket_shapes: bool = True
    """Round plan shapes up (see :mod:`hf_distca.kernels.cudnn_frontend`); False declares exact shapes."""
    backward_rows: int = 65536
    """The most query rows (and key rows) one backward launch covers; a longer call runs as several launches
    over whole sequences (a longer sequence alone). cuDNN's backward workspace holds float32 accumulators of
    about 3 x rows x Hq x D (24 GiB for one launch over 512K rows of 32 x 128 heads, 3 GiB at the default).
    0: one launch per call."""

    def __post_init__(self) -> None:
        check_strategy(self.suffix_strategy)
        if not isinstance(self.backward_rows, int) or self.backward_rows < 0:
            raise ValueError(f"CudnnOptions.backward_rows must be an int >= 0, got {self.backward_rows!r}")


DEFAULT_OPTIONS = CudnnOptions()


def _row_index(starts: tuple[int, ...], lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """(sum(lengths),) int64 on ``device``: the rows of sequences at these starts, in order."""
    lens = torch.tensor(lengths, dtype=torch.int64)
    shift = torch.tensor(starts, dtype=torch.int64) - (torch.cumsum(lens, 0) - lens)  # start - packed start
    rows = torch.arange(int(lens.sum()), dtype=torch.int64) + torch.repeat_interleave(shift, lens)
    return host_to_device(rows, device)  # pinned on CUDA: no host wait


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqs: PackedSeqs,
    scale: float,
    options: CudnnOptions = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = aligned(q), aligned(k), aligned(v)
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
    dout, q, k, v, out = (aligned(t) for t in (dout, q, k, v, out))
    lse = aligned(lse.float())
    dq = torch.empty_like(q)  # every query row is written by exactly one non-side call
    dk = torch.zeros_like(k)  # keys of sequences without queries are written by no call
    dv = torch.zeros_like(v)
    for whole in plan_calls(seqs, options.suffix_strategy):
        for call in split_call(whole, options.backward_rows):
            _backward_launch(call, (q, k, v, out, lse, dout), (dq, dk, dv), scale, options)
    return dq, dk, dv


def _packed_view(tensors: tuple[torch.Tensor, ...], rows: tuple[int, ...], lens: tuple[int, ...]) -> bool:
    """Whether the sequences at ``rows`` lie back to back from ``rows[0]`` and a view of every tensor
    starting there keeps cuDNN's 16-byte alignment (then the launch reads and writes views, no gather)."""
    first = rows[0]
    if rows != tuple(first + s for s in packed_starts(lens)):
        return False
    return all((t.data_ptr() + first * t.stride(0) * t.element_size()) % 16 == 0 for t in tensors)


def _backward_launch(
    call: KernelCall,
    inputs: tuple[torch.Tensor, ...],
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
    options: CudnnOptions,
) -> None:
    """One backward launch on packed operands: views where the call's rows are one aligned run, else
    gathered rows, its gradients written (or, for a split's side part, added) at the call's rows."""
    q, k, v, out, lse, dout = inputs
    dq, dk, dv = grads
    q_starts, k_starts = packed_starts(call.q_lens), packed_starts(call.k_lens)
    packed = KernelCall(
        call.mask, q_starts, k_starts, call.q_lens, call.k_lens, q_starts, call.side, call.window
    )
    rows, keys = sum(call.q_lens), sum(call.k_lens)
    r0, k0 = call.q_rows[0], call.k_rows[0]
    q_view = _packed_view((q, out, dout, lse, dq), call.q_rows, call.q_lens)
    k_view = _packed_view((k, v, dk, dv), call.k_rows, call.k_lens)
    if q_view:
        q_c, out_c, dout_c, lse_c = (t[r0 : r0 + rows] for t in (q, out, dout, lse))  # (rows, ...)
    else:
        q_index = _row_index(call.q_rows, call.q_lens, q.device)
        q_c, out_c, dout_c, lse_c = (t.index_select(0, q_index) for t in (q, out, dout, lse))  # (rows, ...)
    if k_view:
        k_c, v_c, dk_c, dv_c = (t[k0 : k0 + keys] for t in (k, v, dk, dv))  # (keys, Hkv, D)
    else:
        k_index = _row_index(call.k_rows, call.k_lens, k.device)
        k_c, v_c = k.index_select(0, k_index), v.index_select(0, k_index)  # (keys, Hkv, D)
        dk_c, dv_c = torch.empty_like(k_c), torch.empty_like(v_c)
    dq_c = (
        dq[r0 : r0 + rows] if q_view and not call.side else q.new_empty(rows, *q.shape[1:])
    )  # (rows, Hq, D)
    fwd_c = ForwardTensors(q_c, k_c, v_c, out_c, lse_c)
    launch_backward(packed, dout_c, fwd_c, (dq_c, dk_c, dv_c), scale, bucket_shapes=options.bucket_shapes)
    if call.side:  # the non-causal part of split sequences: add onto the causal part's dq
        if q_view:
            dq[r0 : r0 + rows] += dq_c
        else:
            dq.index_add_(0, q_index, dq_c)
    elif not q_view:
        dq.index_copy_(0, q_index, dq_c)
    if not k_view:
        dk.index_copy_(0, k_index, dk_c)
        dv.index_copy_(0, k_index, dv_c)
