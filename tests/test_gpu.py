"""CUDA kernel backends (torch_varlen, flash_attn when installed) against the fp32 reference kernel.

bf16, GQA 32/8 heads x 128, query shards at the end of KV prefixes (cu_seqlens_q != cu_seqlens_k)
and whole documents, lengths up to 8K. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from tolerances import TOL

from hf_distca.kernels import available_backends, reference_varlen_attention, varlen_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


HQ, HKV, D = 32, 8, 128
SHAPES = {
    # (q_lens, k_lens)
    "whole_docs": ([1, 129, 1000, 2048, 8192], [1, 129, 1000, 2048, 8192]),
    "q_shards_kv_prefix": ([128, 1, 1000, 2048, 4096], [1024, 1, 3000, 2048, 8192]),
}


def _backends() -> list[str]:
    if not torch.cuda.is_available():
        return []
    return [b for b in available_backends(torch.device("cuda"), torch.bfloat16) if b != "reference"]


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _run(fn, q, k, v, dout):
    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, lse = fn(qq, kk, vv)
    out.backward(dout)
    return out.detach().float(), lse.float(), qq.grad.float(), kk.grad.float(), vv.grad.float()


@pytest.mark.parametrize("case", sorted(SHAPES))
@pytest.mark.parametrize("backend", ["torch_varlen", "flash_attn"])
def test_cuda_backend_matches_reference(backend, case):
    if backend not in _backends():
        pytest.skip(f"backend {backend} is not available here")
    q_lens, k_lens = SHAPES[case]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(sum(q_lens), HQ, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(sum(k_lens), HKV, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(sum(k_lens), HKV, D, device="cuda", generator=g).bfloat16()
    dout = torch.randn(q.shape, device="cuda", generator=g).bfloat16()
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    scale = D**-0.5

    got = _run(
        lambda a, b, c: varlen_attention(
            a, b, c, cu_q, cu_k, max(q_lens), max(k_lens), scale=scale, return_lse=True, backend=backend
        ),
        q,
        k,
        v,
        dout,
    )

    def reference(a, b, c):
        # float32 math on the same bf16 values; output kept in float32 (no bf16 rounding on the oracle side)
        return reference_varlen_attention(
            a.float(),
            b.float(),
            c.float(),
            cu_q,
            cu_k,
            max(q_lens),
            max(k_lens),
            scale=scale,
            return_lse=True,
        )

    want = _run(reference, q, k, v, dout.float())

    rtol, atol = TOL["gpu_out"]
    torch.testing.assert_close(got[0], want[0], rtol=rtol, atol=atol, msg=lambda m: f"out: {m}")
    rtol, atol = TOL["gpu_lse"]
    torch.testing.assert_close(got[1], want[1], rtol=rtol, atol=atol, msg=lambda m: f"lse: {m}")
    rtol, scale_tol = TOL["gpu_grad"]
    for name, a, b in zip(("dq", "dk", "dv"), got[2:], want[2:]):
        assert b.abs().max() > 0
        atol = scale_tol * float(b.abs().max())
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def test_auto_backend_on_cuda_bf16_is_a_gpu_kernel():
    assert available_backends(torch.device("cuda"), torch.bfloat16)[0] in ("flash_attn", "torch_varlen")
    assert available_backends(torch.device("cuda"), torch.float32) == ["reference"]


def test_tiny_llama_bf16_on_cuda_matches_per_document_sdpa():
    """The whole path on GPU: a bf16 model under distca (CUDA kernel) vs SDPA one document at a time."""
    from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, LlamaConfig

    import hf_distca  # noqa: F401  (registers "distca")

    cfg = LlamaConfig(
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=512,
        vocab_size=128,
        max_position_embeddings=4096,
        initializer_range=0.05,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="distca").to("cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (1, 7, 300, 33, 1000, 129)]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": d} for d in docs])
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
