"""Tensors past 2**31 elements on one GPU: every kernel backend, the engine, the offload, the tiled MLP, the loss.

At 512K tokens Llama-3-8B's queries and attention outputs (32 heads x 128) hold more than 2**31 elements: any
int32 element offset in a kernel, a gather or a copy wraps there (ALST crashed at 555K tokens in a Triton
kernel before Liger moved to 64-bit indexing). Every test here runs T = 540672 tokens (528K) with 32 query heads
and 8 KV heads of 128 in bf16, so q holds 2.2e9 elements; rows from ``BEYOND`` = 524288 on start past element
2**31, and each test compares rows there (and before) against a reference:

- kernels, packed documents: 64 documents of 8448 tokens and one CA-task suffix shard (4096 queries at the end
  of 8192 keys, past element 2**31), forward (output, log-sum-exp) and backward (dq, dk, dv) of every CUDA
  backend installed (cudnn in both suffix strategies, flash_attn; torch_varlen refuses them), against float32
  ``scaled_dot_product_attention`` per document on the same bf16 values (documents before, across and after
  element 2**31), TOL["gpu_out"], ["gpu_lse"], ["gpu_grad"]; every entry finite;
- kernels, one 528K-token document: the last 256 query rows (out, lse, dq) and the last 256 keys (dk, dv,
  which only those queries see) against float32 attention over the whole document: the kernels' row offsets
  inside one sequence pass 2**31 elements (a varlen kernel that computes ``row x heads x head_dim`` in int32
  fails here and not on packed documents);
- the engine: :func:`hf_distca.core_attention` on one process with a layout that holds each document's two
  halves far apart (its gathers and scatters move rows across element 2**31), forward and backward, against the
  same kernel called directly on the documents in order: output bit-exact, gradients TOL["gpu_grad"] (the
  backward kernels accumulate dq with atomics);
- the offload hooks: two 2.2e9-element activations saved through :class:`hf_distca.engine.offload.Offloader`'s
  saved-tensor hooks into the page-locked host arena (the second one's unpack prefetches the first) come back
  bit-exact;
- the tiled MLP: a SwiGLU MLP of 4096 -> 4096 -> 4096 on (1, T, 4096) in tiles of 4096 tokens (T x intermediate
  is 2.2e9 per projection; tile 128 starts exactly at element 2**31 of the input), output and input gradient of
  the tiles before, at and after element 2**31 bit-exact against the plain MLP run on that tile alone;
- the loss (when liger-kernel is installed: the recipe's ``--liger``): Liger's fused linear cross-entropy
  (``LigerForCausalLMLoss``) on (1, T, 4096) hidden states and a 128256-token vocabulary (its logits chunks
  hold 4.2e9 elements), loss against a chunked float32 cross-entropy (TOL["gpu_lse"], relative) and the
  hidden states' gradient of rows before, across and past element 2**31 against the closed form
  (TOL["gpu_grad"]).

Skipped without CUDA. Sized for one H200 (141 GB): each test's peak allocated memory is asserted under
``PEAK_GIB`` and freed before the next; the file runs in about 2 minutes there.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from tolerances import TOL
from torch.autograd.graph import saved_tensors_hooks

from hf_distca import DistCAConfig, core_attention
from hf_distca.engine import EngineState
from hf_distca.engine.host_arena import HostArena
from hf_distca.engine.offload import Offloader
from hf_distca.kernels import attention_backward, attention_forward, available_backends, cudnn_backend
from hf_distca.tiled_mlp import TiledMLP

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HQ, HKV, D = 32, 8, 128
DOC, DOCS = 8448, 64
TOKENS = DOC * DOCS  # 540672: q holds 2.2e9 elements
BEYOND = 2**31 // (HQ * D)  # 524288: the first row of q whose elements start past 2**31
HIDDEN = 4096
PEAK_GIB = 100  # what any one test may hold on the GPU at once
# a CA-task suffix shard after the 64 documents: its queries (rows 540672..544767) all lie past element 2**31
SUFFIX_Q, SUFFIX_K = 4096, 8192
Q_LENS, K_LENS = [DOC] * DOCS + [SUFFIX_Q], [DOC] * DOCS + [SUFFIX_K]
# the sequences compared with the reference: the first, a middle one, the last wholly before element 2**31,
# the one across it (document 62: rows 523776..532223) and every one after it
CHECKED = (0, DOCS // 2, 61, 62, 63, 64)
VARIANTS = ["cudnn:split", "cudnn:bottom_right", "torch_varlen", "flash_attn"]


@pytest.fixture(autouse=True)
def _bounded_memory():
    """Each test starts from an empty cache, and its peak allocated memory stays under PEAK_GIB."""
    if not torch.cuda.is_available():
        yield
        return
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    yield
    peak = torch.cuda.max_memory_allocated() / 2**30
    gc.collect()
    torch.cuda.empty_cache()
    print(f"peak allocated {peak:.1f} GiB")
    assert peak < PEAK_GIB, f"peak allocated {peak:.1f} GiB, over the {PEAK_GIB} GiB this file keeps to"


def _usable() -> list[str]:
    return [b for b in available_backends(torch.device("cuda"), torch.bfloat16) if b != "reference"]


def _select(variant: str) -> dict:
    """attention_forward/attention_backward's keyword arguments that run ``variant``."""
    backend, _, strategy = variant.partition(":")
    if backend not in _usable():
        pytest.skip(f"backend {backend} is not available here")
    if strategy:
        return {"backend": backend, "cudnn_options": cudnn_backend.CudnnOptions(suffix_strategy=strategy)}
    return {"backend": backend}


def _bounds(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _randn(*shape: int, seed: int) -> torch.Tensor:
    """Standard normal bf16 on the GPU, drawn in bf16 (no float32 copy of a 2**31-element tensor)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)


def _assert_close(name: str, got: torch.Tensor, want: torch.Tensor, tol: str) -> None:
    """``got`` against the float32 ``want``; gradients (TOL["gpu_grad"]) with an absolute floor of atol x the
    largest |entry| of the reference, as tests/test_gpu.py compares them."""
    rtol, atol = TOL[tol]
    if tol == "gpu_grad":
        assert want.abs().max() > 0, f"{name}: an all-zero reference gradient checks nothing"
        atol = atol * float(want.abs().max())
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def _all_finite(name: str, t: torch.Tensor) -> None:
    assert bool(torch.isfinite(t).all()), f"{name} has non-finite entries"


# ------------------------------------------------------------------------------------ kernels, packed
def _sdpa_reference(q, k, v, dout):
    """One sequence's (out, lse, dq, dk, dv) in float32 from its bf16 rows: q, dout (lq, Hq, D), k, v (lk, Hkv, D),
    causal aligned bottom-right; torch's scaled_dot_product_attention, gradients by autograd."""
    lq, lk = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    qq, kk, vv = (t.float().requires_grad_(True) for t in (q, k, v))
    # (1, H, l, D): 4-D, so that SDPA runs its memory-efficient float32 kernel, not the math one
    heads = [qq.transpose(0, 1)] + [t.repeat_interleave(groups, dim=1).transpose(0, 1) for t in (kk, vv)]
    heads = [t.unsqueeze(0) for t in heads]
    allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)  # key j <= r + lk - lq
    if lq == lk:
        out = F.scaled_dot_product_attention(*heads, is_causal=True)  # (1, Hq, lq, D)
    else:  # query r is key position r + lk - lq (bottom-right; SDPA's is_causal aligns top-left)
        out = F.scaled_dot_product_attention(*heads, attn_mask=allowed)
    out = out[0].transpose(0, 1)  # (lq, Hq, D)
    out.backward(dout.float())
    with torch.no_grad():  # the log-sum-exp of the scaled scores, a few heads at a time
        keys = heads[1][0].detach()  # (Hq, lk, D)
        lse = torch.cat([
            (qq[:, h : h + 8].detach().transpose(0, 1) @ keys[h : h + 8].transpose(1, 2) * D**-0.5)
            .masked_fill(~allowed, float("-inf"))
            .logsumexp(-1)
            for h in range(0, q.shape[1], 8)
        ]).transpose(0, 1)  # (lq, Hq)  # fmt: skip
    return out.detach(), lse, qq.grad, kk.grad, vv.grad


@pytest.mark.parametrize("variant", VARIANTS)
def test_backend_on_packed_documents_past_2_31_elements(variant):
    run = _select(variant)
    qb, kb = _bounds(Q_LENS), _bounds(K_LENS)
    q, dout = _randn(qb[-1], HQ, D, seed=1), _randn(qb[-1], HQ, D, seed=2)  # (544768, 32, 128): 2.2e9 each
    k, v = _randn(kb[-1], HKV, D, seed=3), _randn(kb[-1], HKV, D, seed=4)
    assert q.numel() > 2**31 and qb[62] < BEYOND < qb[63]
    cu_q, cu_k = torch.tensor(qb, dtype=torch.int32), torch.tensor(kb, dtype=torch.int32)  # on the host
    args = (cu_q, cu_k, max(Q_LENS), max(K_LENS))
    if variant == "torch_varlen":  # its kernel wrote non-finite outputs past 2**31 elements: refused
        with pytest.raises(ValueError, match="backend 'torch_varlen': q of this call hold"):
            attention_forward(q, k, v, *args, **run)
        return
    out, lse = attention_forward(q, k, v, *args, **run)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, *args, **run)
    for name, t in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        _all_finite(name, t)
    for i in CHECKED:
        rows, keys = slice(qb[i], qb[i + 1]), slice(kb[i], kb[i + 1])
        want = _sdpa_reference(q[rows], k[keys], v[keys], dout[rows])
        got = (out[rows], lse[rows], dq[rows], dk[keys], dv[keys])
        for name, a, b, tol in zip(
            ("out", "lse", "dq", "dk", "dv"),
            got,
            want,
            ("gpu_out", "gpu_lse", "gpu_grad", "gpu_grad", "gpu_grad"),
        ):
            _assert_close(f"{variant} sequence {i} (rows {qb[i]}..{qb[i + 1]}) {name}", a, b, tol)


# ---------------------------------------------------------------------------------- kernels, one document
LAST = 256  # query rows (and keys) of the long document checked at its end


def _last_rows_reference(q, k, v, dout):
    """Of one causal document (q, dout (T, Hq, D), k, v (T, Hkv, D) in bf16): out, lse and dq of its last LAST
    query rows and dk, dv of its last LAST keys (only those queries see them), in float32, exact up to float32
    rounding; one KV head's query group at a time, gradients by autograd."""
    t, groups = q.shape[0], q.shape[1] // k.shape[1]
    allowed = torch.arange(t, device=q.device) <= torch.arange(t - LAST, t, device=q.device).unsqueeze(1)
    outs, lses, dqs, dks, dvs = [], [], [], [], []
    for g in range(k.shape[1]):
        heads = slice(g * groups, (g + 1) * groups)
        qq = q[t - LAST :, heads].float().requires_grad_(True)  # (LAST, groups, D)
        kk = k[:, g].float().requires_grad_(True)  # (T, D)
        vv = v[:, g].float().requires_grad_(True)
        scores = torch.einsum("qhd,kd->hqk", qq, kk) * D**-0.5  # (groups, LAST, T)
        scores = scores.masked_fill(~allowed, float("-inf"))
        lse = scores.logsumexp(-1)  # (groups, LAST)
        out = torch.einsum("hqk,kd->qhd", torch.exp(scores - lse.unsqueeze(-1)), vv)  # (LAST, groups, D)
        out.backward(dout[t - LAST :, heads].float())
        outs.append(out.detach())
        lses.append(lse.detach().transpose(0, 1))
        dqs.append(qq.grad)
        dks.append(kk.grad[t - LAST :])
        dvs.append(vv.grad[t - LAST :])
        del scores, out, lse, qq, kk, vv
    return (
        torch.cat(outs, 1),  # (LAST, Hq, D)
        torch.cat(lses, 1),  # (LAST, Hq)
        torch.cat(dqs, 1),  # (LAST, Hq, D)
        torch.stack(dks, 1),  # (LAST, Hkv, D)
        torch.stack(dvs, 1),
    )


@pytest.mark.parametrize("backend", ["cudnn", "torch_varlen", "flash_attn"])
def test_backend_on_one_document_past_2_31_elements(backend):
    """One 528K-token document (a few seconds of attention per direction on an H200): the rows at its end lie
    past element 2**31 of q within one sequence."""
    if backend not in _usable():
        pytest.skip(f"backend {backend} is not available here")
    q, dout = _randn(TOKENS, HQ, D, seed=5), _randn(TOKENS, HQ, D, seed=6)
    k, v = _randn(TOKENS, HKV, D, seed=7), _randn(TOKENS, HKV, D, seed=8)
    cu = torch.tensor([0, TOKENS], dtype=torch.int32)
    args = (cu, cu, TOKENS, TOKENS)
    if backend == "torch_varlen":  # refused past 2**31 elements (test_backend_on_packed_documents_...)
        with pytest.raises(ValueError, match="backend 'torch_varlen': q of this call hold"):
            attention_forward(q, k, v, *args, backend=backend)
        return
    out, lse = attention_forward(q, k, v, *args, backend=backend)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, *args, backend=backend)
    for name, t in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        _all_finite(name, t)
    want = _last_rows_reference(q, k, v, dout)
    tail = slice(TOKENS - LAST, TOKENS)
    got = (out[tail], lse[tail], dq[tail], dk[tail], dv[tail])
    for name, a, b, tol in zip(
        ("out", "lse", "dq", "dk", "dv"),
        got,
        want,
        ("gpu_out", "gpu_lse", "gpu_grad", "gpu_grad", "gpu_grad"),
    ):
        _assert_close(f"{backend} last {LAST} rows {name}", a, b, tol)


# ----------------------------------------------------------------------------------------------- engine
def test_engine_one_rank_past_2_31_elements_matches_the_kernel():
    """core_attention on one process: each document's halves lie far apart in local rows (first halves in reverse
    document order, then the second halves), so the engine gathers every document across element 2**31 into one
    kernel call and scatters outputs and gradients back; the direct call on the documents in order is the
    reference (the same kernel on the same rows: a bit-exact forward)."""
    if not _usable():
        pytest.skip("no CUDA kernel backend is installed")
    backend = _usable()[0]  # what backend="auto" runs
    half = DOC // 2
    pieces = [(d, 0, half) for d in reversed(range(DOCS))] + [(d, half, half) for d in range(DOCS)]
    starts, row = {}, 0  # (doc, doc_start) -> local row
    for doc, doc_start, n in pieces:
        starts[doc, doc_start] = row
        row += n
    order = torch.cat([
        torch.arange(starts[d, s], starts[d, s] + half, dtype=torch.int64) for d in range(DOCS) for s in (0, half)
    ]).cuda()  # (T,): the local rows of the documents in order  # fmt: skip
    q, dout = _randn(TOKENS, HQ, D, seed=9), _randn(TOKENS, HQ, D, seed=10)
    k, v = _randn(TOKENS, HKV, D, seed=11), _randn(TOKENS, HKV, D, seed=12)

    # the reference: the kernel directly, documents in order, results put back in local row order
    cu = torch.arange(DOCS + 1, dtype=torch.int32) * DOC
    args = (cu, cu, DOC, DOC)
    q_o, k_o, v_o = (t.index_select(0, order) for t in (q, k, v))
    out_o, lse_o = attention_forward(q_o, k_o, v_o, *args, backend=backend)
    grads_o = attention_backward(
        dout.index_select(0, order), q_o, k_o, v_o, out_o, lse_o, *args, backend=backend
    )
    del q_o, k_o, v_o, lse_o
    want = [torch.empty_like(t) for t in (q, q, k, v)]  # out, dq, dk, dv in local row order
    for w, t in zip(want, (out_o, *grads_o)):
        w.index_copy_(0, order, t)
    del out_o, grads_o

    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    out = core_attention(
        *leaves, pieces, config=DistCAConfig(backend=backend, cost_table=None), state=EngineState()
    )
    out.backward(dout)
    del dout
    rtol, atol = TOL["exact"]
    torch.testing.assert_close(out.detach(), want[0], rtol=rtol, atol=atol, msg=lambda m: f"out: {m}")
    rows = {
        "first": slice(0, half),
        "across": slice(BEYOND - half, BEYOND + half),
        "last": slice(-2 * half, None),
    }
    for name, got, ref in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), want[1:]):
        _all_finite(name, got)
        for where, r in rows.items():
            _assert_close(f"{backend} engine {name} rows {where}", got[r], ref[r].float(), "gpu_grad")


# ---------------------------------------------------------------------------------------------- offload
class _Keep(torch.autograd.Function):
    """Saves its input and returns it as its gradient: the input's .grad is what the unpack brought back."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.save_for_backward(x)
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return x.clone()


def test_offloaded_activations_past_2_31_elements_come_back_bit_exact():
    offloader = Offloader(HostArena(pin=True))
    tensors = [_randn(TOKENS, HIDDEN, seed=13), _randn(TOKENS, HIDDEN, seed=14)]  # 2.2e9 elements each
    assert tensors[0].numel() > 2**31
    losses = []
    for x in tensors:
        group = offloader.begin_group()  # one per layer call; the second's unpack prefetches the first
        with saved_tensors_hooks(offloader.packer(group), offloader.unpack):
            losses.append(_Keep.apply(x.requires_grad_(True)))
    nbytes = 2 * TOKENS * HIDDEN * 2
    assert offloader.tensors_offloaded == 2 and offloader.bytes_offloaded == nbytes
    assert offloader.arena.pin and offloader.arena.used_bytes >= nbytes
    sum(losses).backward()
    torch.cuda.synchronize()
    assert offloader.groups_prefetched >= 1
    for i, x in enumerate(tensors):
        assert torch.equal(x.grad, x.detach()), f"offloaded activation {i} came back changed"
    del losses
    gc.collect()
    assert offloader.live == 0 and offloader.arena.live == 0  # every host view given back


# -------------------------------------------------------------------------------------------- tiled MLP
class _SwiGLU(torch.nn.Module):
    """Llama's MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = torch.nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def test_tiled_mlp_past_2_31_elements_is_exact_per_tile():
    tile = 4096
    torch.manual_seed(0)
    mlp = _SwiGLU(HIDDEN, HIDDEN).cuda().bfloat16()  # T x intermediate: 2.2e9 per projection untiled
    tiled = TiledMLP(mlp, tile)
    x = _randn(1, TOKENS, HIDDEN, seed=15).requires_grad_(True)  # 2.2e9 elements
    grad = _randn(1, TOKENS, HIDDEN, seed=16)
    out = tiled(x)
    out.backward(grad)
    assert x.grad is not None and all(p.grad is not None for p in mlp.parameters())
    _all_finite("dx", x.grad)
    for name, p in mlp.named_parameters():
        _all_finite(name, p.grad)
    assert BEYOND % tile == 0  # tile BEYOND // tile starts exactly at element 2**31 of x
    rtol, atol = TOL["exact"]  # the same module on the same rows in the same shape: bit-identical
    for i in (0, BEYOND // tile - 1, BEYOND // tile, TOKENS // tile - 1):
        rows = slice(i * tile, (i + 1) * tile)
        part = x[0, rows].detach().requires_grad_(True)  # (tile, hidden)
        want = mlp(part.view_as(part))  # the graph the tiled backward builds per tile
        want_dx, *_ = torch.autograd.grad(want, [part, *mlp.parameters()], grad[0, rows])
        torch.testing.assert_close(out.detach()[0, rows], want.detach(), rtol=rtol, atol=atol, msg=lambda m, i=i: f"tile {i} out: {m}")  # fmt: skip
        torch.testing.assert_close(x.grad[0, rows], want_dx, rtol=rtol, atol=atol, msg=lambda m, i=i: f"tile {i} dx: {m}")  # fmt: skip


# ------------------------------------------------------------------------------------------------- loss
VOCAB = 128256  # Llama 3's
LOSS_CHUNK = 8192  # rows of the reference's float32 logits at a time (4.2 GB)


def _liger_loss():
    """The loss --liger trains with (Transformers' use_liger_kernel: LigerForCausalLMLoss, a sum over the
    batch's shift_labels divided by num_items_in_batch), or the same through the functional API."""
    pytest.importorskip("liger_kernel")
    try:
        from liger_kernel.transformers.model.loss_utils import LigerForCausalLMLoss
    except ImportError:
        LigerForCausalLMLoss = None  # noqa: N806
    if LigerForCausalLMLoss is not None:
        return lambda h, w, labels, n: LigerForCausalLMLoss(
            h, w, None, hidden_size=h.shape[-1], num_items_in_batch=n, shift_labels=labels
        )
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return lambda h, w, labels, n: (
        liger_fused_linear_cross_entropy(h.view(-1, h.shape[-1]), w, labels.view(-1), reduction="sum") / n
    )


def test_liger_fused_linear_cross_entropy_past_2_31_elements():
    loss_fn = _liger_loss()
    hidden = _randn(1, TOKENS, HIDDEN, seed=17).requires_grad_(True)  # 2.2e9 elements
    weight = _randn(VOCAB, HIDDEN, seed=18) * 0.02  # logits of std ~1.3; not trained here
    g = torch.Generator(device="cuda").manual_seed(19)
    labels = torch.randint(0, VOCAB, (1, TOKENS), device="cuda", generator=g)
    labels[
        0, DOC - 1 :: DOC
    ] = -100  # a document's last token predicts nothing (shift_labels of packed documents)
    n = int((labels != -100).sum())
    loss = loss_fn(hidden, weight, labels, n)
    loss.backward()
    dx = hidden.grad[0]  # (T, hidden)
    _all_finite("dhidden", dx)

    x, y = hidden.detach()[0], labels[0]
    total = torch.zeros((), dtype=torch.float64, device="cuda")
    for start in range(0, TOKENS, LOSS_CHUNK):  # logits in bf16 as Liger computes them, the loss in float32
        logits = (x[start : start + LOSS_CHUNK] @ weight.T).float()
        total += F.cross_entropy(
            logits, y[start : start + LOSS_CHUNK], ignore_index=-100, reduction="sum"
        ).double()
        del logits
    want_loss = float(total) / n
    assert abs(float(loss) - want_loss) <= TOL["gpu_lse"][0] * abs(want_loss), (float(loss), want_loss)

    # d loss / d x_r = (softmax(logits_r) - onehot(y_r)) W / n (zero for ignored rows)
    rows = torch.cat([
        torch.arange(0, 256), torch.arange(BEYOND - 512, BEYOND + 512), torch.arange(TOKENS - 1024, TOKENS)
    ]).cuda()  # fmt: skip
    probs = torch.softmax((x[rows] @ weight.T).float(), -1)  # (rows, V)
    valid = y[rows] != -100
    probs[valid, y[rows][valid]] -= 1
    probs[~valid] = 0
    want_dx = probs @ weight.float() / n  # (rows, hidden)
    _assert_close("liger dhidden", dx[rows], want_dx, "gpu_grad")
