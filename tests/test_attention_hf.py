"""attn_implementation="distca" inside real (tiny, random) Transformers models.

The oracle is the same model under SDPA run document by document (each document its own batch of 1),
so a packed batch must reproduce it exactly up to float32 rounding: logits and the gradient of every
parameter. Also: packing helpers, padding, save/reload, gradient checkpointing, generation with a KV
cache (token for token against SDPA), every refusal, and the distributed path (enable_distca +
distca_layout) on 1 and 2 processes.
"""

from __future__ import annotations

import copy
import math
import types

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import TOL
from transformers import (
    AutoModelForCausalLM,
    DataCollatorWithFlattening,
    Gemma2Config,
    Gemma3TextConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

import hf_distca
from hf_distca import DistCAConfig, enable_distca
from hf_distca.attention import distca_attention_forward, distca_padding_mask
from hf_distca.features import UnsupportedFeatureError
from hf_distca.packing import (
    lengths_from_cu_seqlens,
    lengths_from_position_ids,
    packed_document_lengths,
    pieces_from_lengths,
    scatter_rows,
    unpad,
)

CONFIGS = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "mistral": MistralConfig,
    "gemma3": Gemma3TextConfig,  # Gemma3ForCausalLM: 5 sliding-window layers to 1 global by default
}
EAGER_ONLY_CONFIGS = {  # no SDPA in Transformers: their oracle is 'eager' (tests/test_softcap_sinks.py)
    "gemma2": Gemma2Config,  # local (window) and global layers alternate, every one logit-softcapped
    "gpt_oss": GptOssConfig,  # sliding and full layers alternate, every one with attention sinks; MoE MLP
}
DOC_SETS = {
    # length-1 documents, odd lengths, one long (~300) document
    "mixed": [1, 7, 300, 2, 33, 1, 64, 5],
    # many short documents (seeded random lengths 1..12)
    "many_short": torch.randint(1, 13, (40,), generator=torch.Generator().manual_seed(7)).tolist(),
}


def tiny_config(arch: str, **overrides):
    kwargs = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=1024,
        initializer_range=0.2,
        attention_dropout=0.0,
    )
    if arch == "mistral":
        kwargs["sliding_window"] = None
    if arch == "gemma3":  # its scaling is query_pre_attn_scalar ** -0.5, not head_dim ** -0.5
        kwargs.update(num_hidden_layers=6, query_pre_attn_scalar=24, sliding_window=16)
    if arch == "gemma2":  # a cap of 2 bends the tiny model's scores (Gemma 2's own: 50)
        kwargs.update(query_pre_attn_scalar=24, sliding_window=16, attn_logit_softcapping=2.0)
    if arch == "gpt_oss":  # 4 experts, 2 per token; max_position_embeddings = its YaRN factor x 4096
        kwargs.update(
            num_local_experts=4, num_experts_per_tok=2, sliding_window=16, max_position_embeddings=131072
        )
    kwargs.update(overrides)
    return {**CONFIGS, **EAGER_ONLY_CONFIGS}[arch](**kwargs)


def tiny_model(arch: str, attn: str = "distca", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), attn_implementation=attn)
    return model.float()


def random_docs(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]


def packed_batch(docs: list[list[int]]) -> dict:
    return DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": d} for d in docs])


def doc_loss_sum(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """Summed next-token cross entropy inside one document. logits: (L, V)."""
    if len(ids) < 2:
        return logits.sum() * 0
    return F.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]), reduction="sum")


def n_labels(docs: list[list[int]]) -> int:
    return sum(len(d) - 1 for d in docs)


def grads_of(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def per_document_reference(model, docs: list[list[int]], attn: str = "sdpa") -> tuple[torch.Tensor, dict]:
    """Oracle: SDPA (or ``attn``), one document per forward; logits concatenated (1, T, V); grads of the
    mean loss."""
    model.set_attn_implementation(attn)
    model.zero_grad(set_to_none=True)
    logits, loss = [], 0.0
    for d in docs:
        out = model(input_ids=torch.tensor([d]), use_cache=False).logits  # (1, L, V)
        logits.append(out.detach())
        loss = loss + doc_loss_sum(out[0], d)
    (loss / n_labels(docs)).backward()
    return torch.cat(logits, dim=1), grads_of(model)


def packed_run(model, docs, **inputs) -> tuple[torch.Tensor, dict]:
    """distca on one packed row; the loss is split by document exactly like the oracle's."""
    model.set_attn_implementation("distca")
    model.zero_grad(set_to_none=True)
    logits = model(**inputs, use_cache=False).logits  # (1, T, V)
    pieces = logits[0].split([len(d) for d in docs])
    loss = sum(doc_loss_sum(lg, d) for lg, d in zip(pieces, docs))
    (loss / n_labels(docs)).backward()
    return logits.detach(), grads_of(model)


def assert_grads_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and len(got) > 0
    rtol, scale = TOL["grads"]
    for name in want:
        atol = scale * float(want[name].abs().max())
        torch.testing.assert_close(
            got[name], want[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )


def assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    rtol, atol = TOL["logits"]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------------------------
# packing helpers


def test_lengths_from_position_ids():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 5, 6]])
    # restarts at 0, and a jump (1 -> 5) also starts a new document
    assert lengths_from_position_ids(pos) == [3, 2, 1, 2, 2]
    assert lengths_from_position_ids(torch.tensor([4, 5, 6])) == [3]  # offset start: one document
    assert lengths_from_position_ids(torch.tensor([], dtype=torch.long)) == []


def test_lengths_from_cu_seqlens_validates():
    assert lengths_from_cu_seqlens(torch.tensor([0, 3, 3, 8]), torch.tensor([0, 3, 3, 8]), total=8) == [
        3,
        0,
        5,
    ]
    with pytest.raises(ValueError, match="cu_seq_lens_q and cu_seq_lens_k differ"):
        lengths_from_cu_seqlens([0, 3, 8], [0, 4, 8])
    with pytest.raises(ValueError, match="covers 8 tokens but the packed row holds 9"):
        lengths_from_cu_seqlens([0, 3, 8], total=9)
    with pytest.raises(ValueError, match="must start at 0"):
        lengths_from_cu_seqlens([1, 3])
    with pytest.raises(ValueError, match="non-decreasing"):
        lengths_from_cu_seqlens([0, 3, 2])


def test_packed_document_lengths_sources():
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    # cu_seq_lens win over position ids
    assert packed_document_lengths(1, 5, cu_seq_lens_q=cu, cu_seq_lens_k=cu, position_ids=pos) == [2, 3]
    assert packed_document_lengths(1, 5, position_ids=pos) == [3, 2]
    assert packed_document_lengths(2, 5, position_ids=pos) == [3, 2, 3, 2]  # (1, S) broadcast to rows
    assert packed_document_lengths(2, 5, position_ids=torch.tensor([[0, 1, 2, 3, 4], [0, 1, 0, 1, 2]])) == [
        5,
        2,
        3,
    ]
    assert packed_document_lengths(3, 4) == [4, 4, 4]
    with pytest.raises(ValueError, match="must have batch size 1"):
        packed_document_lengths(2, 5, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert pieces_from_lengths([3, 0, 2]) == [(0, 0, 3), (1, 0, 2)]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=5, max_size=5), min_size=1, max_size=4))
def test_unpad_scatter_roundtrip(mask_rows):
    mask = torch.tensor(mask_rows)  # (B, 5), any padding pattern including fully padded rows
    x = torch.randn(mask.shape[0], 5, 3)
    u = unpad(mask)
    assert u.lengths == mask.sum(1).tolist()
    flat = x.reshape(-1, 3)[u.indices]  # (T, 3)
    assert flat.shape[0] == int(mask.sum())
    back = scatter_rows(flat, u).view_as(x)
    torch.testing.assert_close(back, x * mask.unsqueeze(-1), rtol=0, atol=0)


def test_padding_mask_function():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    got = distca_padding_mask(batch_size=2, q_length=3, kv_length=3, attention_mask=mask, dtype=torch.float32)
    assert got.dtype == torch.bool and got.tolist() == [[True, True, False], [True, True, True]]
    assert distca_padding_mask(2, 3, 3, attention_mask=torch.ones(2, 3, dtype=torch.bool)) is None
    assert distca_padding_mask(2, 3, 3, attention_mask=None) is None


# ---------------------------------------------------------------------------------------------------------
# packed batches == per-document SDPA, for four architectures


@pytest.mark.parametrize("docset", sorted(DOC_SETS))
@pytest.mark.parametrize("source", ["cu_seq_lens", "position_ids"])
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_packed_matches_per_document_sdpa(arch, source, docset):
    docs = random_docs(DOC_SETS[docset], seed=len(arch))
    model = tiny_model(arch)
    ref_logits, ref_grads = per_document_reference(model, docs)
    batch = packed_batch(docs)
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    if source == "cu_seq_lens":
        inputs.update(
            {k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
        )
    logits, grads = packed_run(model, docs, **inputs)
    assert logits.shape == ref_logits.shape == (1, sum(map(len, docs)), 128)
    assert ref_logits.std() > 0.5  # the model is far from trivial (initializer_range 0.2)
    assert_logits_close(logits, ref_logits)
    assert_grads_close(grads, ref_grads)


def test_document_boundaries_matter():
    """Guard against a vacuous oracle: ignoring boundaries (one causal row) is far outside tolerance."""
    docs = random_docs(DOC_SETS["mixed"])
    model = tiny_model("llama")
    ref_logits, _ = per_document_reference(model, docs)
    model.set_attn_implementation("distca")
    ids = packed_batch(docs)["input_ids"]
    with torch.no_grad():
        one_row = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits
    assert (one_row - ref_logits).abs().max() > 100 * TOL["logits"][1]


def test_collator_labels_give_the_same_loss():
    """HF's own loss on the collator's labels (-100 at document starts) equals the per-document loss."""
    docs = random_docs(DOC_SETS["mixed"], seed=3)
    model = tiny_model("llama")
    with torch.no_grad():
        out = model(**packed_batch(docs))
        pieces = out.logits[0].split([len(d) for d in docs])
        want = sum(doc_loss_sum(lg, d) for lg, d in zip(pieces, docs)) / n_labels(docs)
    torch.testing.assert_close(out.loss, want, rtol=1e-6, atol=1e-6)


@pytest.mark.filterwarnings("ignore:.*(gradient|activation)_checkpointing.*:FutureWarning")
def test_gradient_checkpointing():
    docs = random_docs(DOC_SETS["mixed"], seed=5)
    model = tiny_model("llama")
    model.train()
    ref_logits, ref_grads = per_document_reference(model, docs)
    model.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing
    batch = packed_batch(docs)
    logits, grads = packed_run(model, docs, **{k: v for k, v in batch.items() if k != "labels"})
    assert_logits_close(logits, ref_logits)
    assert_grads_close(grads, ref_grads)


# ---------------------------------------------------------------------------------------------------------
# sliding window (Mistral): exact while every document fits the window, refused otherwise


def test_sliding_window_not_shorter_than_documents_is_exact():
    docs = random_docs(DOC_SETS["mixed"], seed=11)  # longest document: 300 tokens
    model = tiny_model("mistral", sliding_window=300)
    ref_logits, ref_grads = per_document_reference(model, docs)
    logits, grads = packed_run(model, docs, **{k: v for k, v in packed_batch(docs).items() if k != "labels"})
    assert_logits_close(logits, ref_logits)
    assert_grads_close(grads, ref_grads)


WINDOWED = {
    # every layer windowed
    "mistral": dict(sliding_window=16),
    # Qwen2/Qwen3: layers from max_window_layers on are windowed (layer_types), the first one global
    "qwen2": dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
    "qwen3": dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
    # 5 local (window 16) layers to 1 global, query_pre_attn_scalar scaling
    "gemma3": {},
}


@pytest.mark.parametrize("arch", sorted(WINDOWED))
def test_sliding_window_shorter_than_documents_is_exact(arch):
    """Documents up to 300 tokens, windows of 16: each layer attends within its own window (sliding layers)
    or the whole document (global layers), exactly as Transformers' SDPA per document."""
    docs = random_docs(DOC_SETS["mixed"], seed=11)
    model = tiny_model(arch, **WINDOWED[arch])
    windows = [
        getattr(layer.self_attn, "sliding_window", model.config.sliding_window)
        for layer in model.model.layers
    ]
    assert 16 in windows and (arch == "mistral" or None in windows), windows
    ref_logits, ref_grads = per_document_reference(model, docs)
    logits, grads = packed_run(model, docs, **{k: v for k, v in packed_batch(docs).items() if k != "labels"})
    assert_logits_close(logits, ref_logits)
    assert_grads_close(grads, ref_grads)
    # the window changes the numbers: the same weights with a window longer than every document (full
    # causal attention) give other logits
    full = tiny_model(arch, **{**WINDOWED[arch], "sliding_window": 4096})
    full_logits, _ = per_document_reference(full, docs)
    assert (full_logits - ref_logits).abs().max() > 0.1


# ---------------------------------------------------------------------------------------------------------
# loading paths


def test_save_and_reload_with_distca(tmp_path):
    docs = random_docs(DOC_SETS["mixed"], seed=13)
    model = tiny_model("qwen3")
    model.eval()
    batch = {k: v for k, v in packed_batch(docs).items() if k != "labels"}
    with torch.no_grad():
        before = model(**batch).logits
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="distca", dtype=torch.float32
    )
    assert reloaded.config._attn_implementation == "distca"
    with torch.no_grad():
        after = reloaded(**batch).logits
    rtol, atol = TOL["exact"]
    torch.testing.assert_close(after, before, rtol=rtol, atol=atol)


def test_set_attn_implementation_switches_to_distca(monkeypatch):
    import hf_distca.attention as attention

    calls = []
    real = attention.local_attention
    monkeypatch.setattr(attention, "local_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = tiny_model("qwen2", attn="sdpa")
    assert model.config._attn_implementation == "sdpa"
    docs = random_docs([17, 40], seed=17)
    ref_logits, _ = per_document_reference(model, docs)
    model.set_attn_implementation("distca")
    assert model.config._attn_implementation == "distca"
    with torch.no_grad():
        logits = model(**{k: v for k, v in packed_batch(docs).items() if k != "labels"}).logits
        single = model(input_ids=torch.tensor([docs[1]])).logits  # no kwargs: the row is one document
    assert len(calls) == 2 * model.config.num_hidden_layers
    assert_logits_close(logits, ref_logits)
    assert_logits_close(single, ref_logits[:, len(docs[0]) :])


# ---------------------------------------------------------------------------------------------------------
# padded batches (batch > 1): unpadded into one document per row


@pytest.mark.parametrize(
    ("arch", "positions"), [("llama", "restarting"), ("qwen3", "restarting"), ("llama", "default")]
)
def test_padded_batch_matches_unpadded_rows(arch, positions):
    rows = random_docs([9, 7, 12], seed=19)
    seq = 12
    ids = torch.zeros(3, seq, dtype=torch.long)
    mask = torch.zeros(3, seq, dtype=torch.long)
    ids[0, :9], mask[0, :9] = torch.tensor(rows[0]), 1  # right padding
    ids[1, 5:], mask[1, 5:] = torch.tensor(rows[1]), 1  # left padding
    ids[2], mask[2] = torch.tensor(rows[2]), 1  # no padding
    # "restarting": what generate() passes (positions count valid tokens); "default": none passed, so
    # Transformers uses 0..S-1 and only the padding mask (which must reach the attention) keeps the
    # left-padded row away from its pad tokens. RoPE is relative: a shifted row gives the same scores.
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0) if positions == "restarting" else None
    valid = mask.bool()

    model = tiny_model(arch)
    ref_logits, ref_grads = per_document_reference(model, rows)  # (1, 28, V)
    model.set_attn_implementation("distca")
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
    got = logits[valid]  # (28, V), rows in order
    pieces = got.split([len(r) for r in rows])
    (sum(doc_loss_sum(lg, r) for lg, r in zip(pieces, rows)) / n_labels(rows)).backward()
    assert_logits_close(got.detach(), ref_logits[0])
    assert_grads_close(grads_of(model), ref_grads)


def test_padded_positions_get_zero_attention_output():
    module = torch.nn.Module()
    q = torch.randn(2, 4, 5, 8)
    k, v = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    mask = torch.tensor([[True, True, True, False, False], [False, True, True, True, True]])
    out, weights = distca_attention_forward(module, q, k, v, mask, scaling=0.3)
    assert weights is None and out.shape == (2, 5, 4, 8)
    assert out[~mask].abs().max() == 0
    assert out[mask].abs().min() > 0


# ---------------------------------------------------------------------------------------------------------
# refusals: each raises the promised error


def _qkv(batch=1, seq=6, kv_seq=None):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 4, seq, 8, generator=g)
    k = torch.randn(batch, 2, kv_seq or seq, 8, generator=g)
    return q, k, k.clone()


def _module(training=False, is_causal=True):
    module = torch.nn.Module()
    module.is_causal = is_causal
    module.train(training)
    return module


@pytest.mark.parametrize(
    ("module_kwargs", "call_kwargs", "error", "match"),
    [
        ({}, {"softcap": -1.0}, ValueError, "softcap must be a positive number"),
        ({}, {"s_aux": torch.zeros(3)}, ValueError, r"sinks \(s_aux\) must be a tensor of one logit per query head, shaped \(4,\)"),
        ({"training": True}, {"dropout": 0.1}, UnsupportedFeatureError, "attention_dropout=0.0"),
        ({"is_causal": False}, {}, UnsupportedFeatureError, "only computes causal"),
        ({}, {"sliding_window": 0}, ValueError, "sliding_window must be a positive int"),
        ({}, {"distca_layout": types.SimpleNamespace(pieces=[(0, 0, 6)], all_pieces=[[(0, 0, 6)]])},
         RuntimeError, r"hf_distca.enable_distca\(model, group=...\)"),
        ({}, {"cu_seq_lens_q": torch.tensor([0, 2, 6]), "cu_seq_lens_k": torch.tensor([0, 3, 6])},
         ValueError, "cross-attention"),
        ({}, {"cu_seq_lens_q": torch.tensor([0, 2, 5])}, ValueError, "covers 5 tokens"),
    ],
)  # fmt: skip
def test_refusals_direct_call(module_kwargs, call_kwargs, error, match):
    q, k, v = _qkv()
    with pytest.raises(error, match=match):
        distca_attention_forward(_module(**module_kwargs), q, k, v, None, **call_kwargs)


def test_dropout_is_fine_in_eval_and_window_is_fine_when_it_fits():
    q, k, v = _qkv()
    out, _ = distca_attention_forward(_module(training=False), q, k, v, None, dropout=0.1, sliding_window=6)
    ref, _ = distca_attention_forward(_module(), q, k, v, None)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_more_queries_than_keys_raises():
    q, k, v = _qkv(seq=6, kv_seq=4)
    with pytest.raises(UnsupportedFeatureError, match="6 queries and only 4 keys: cross-attention"):
        distca_attention_forward(_module(), q, k, v, None)


def test_batch_above_one_with_packing_kwargs_raises():
    q, k, v = _qkv(batch=2)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(
        ValueError, match="packed batches must have batch size 1; use .*DataCollatorWithFlattening"
    ):
        distca_attention_forward(_module(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)


def test_padding_mask_with_packing_kwargs_raises():
    q, k, v = _qkv()
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    with pytest.raises(ValueError, match="pass one"):
        distca_attention_forward(_module(), q, k, v, mask, cu_seq_lens_q=cu, cu_seq_lens_k=cu)


def test_float_mask_raises():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="boolean or 0/1 integer padding mask"):
        distca_attention_forward(_module(), q, k, v, torch.zeros(1, 6))


def test_4d_mask_raises_in_model():
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (1, 6))
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="4-D attention mask"):
        model(input_ids=ids, attention_mask=mask)


def test_output_attentions_warns_and_returns_no_weights():
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with pytest.warns(UserWarning, match="output_attentions=True.*attn_implementation='eager'"):
            out = model(input_ids=ids, output_attentions=True)
    assert all(a is None for a in out.attentions or ())  # no weights, and the warning said so
    torch.testing.assert_close(out.logits, plain, rtol=0, atol=0)


def test_training_with_attention_dropout_raises_in_model():
    model = tiny_model("llama", attention_dropout=0.1)
    model.train()
    with pytest.raises(UnsupportedFeatureError, match="attention dropout"):
        model(input_ids=torch.randint(0, 128, (1, 6)))
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.randint(0, 128, (1, 6))).logits).all()


# ---------------------------------------------------------------------------------------------------------
# past keys (KV cache): queries are the last positions of each row, causal over the whole row


def masked_oracle(q, k, v, mask, scale):
    """float64 attention where query i of row b sits at key position n - S_q + i and sees the valid keys
    up to it. q: (B, Hq, S_q, D); k, v: (B, Hkv, S_k, D); mask: (B, n) bool. Returns (B, S_q, Hq, D)."""
    batch, hq, seq, _ = q.shape
    n = mask.shape[1]
    k, v = k[:, :, :n].double(), v[:, :, :n].double()
    rep = hq // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (B, Hq, n, D)
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k) * scale  # (B, Hq, S_q, n)
    pos = torch.arange(n - seq, n)[:, None]  # (S_q, 1) key position of each query
    allowed = (torch.arange(n)[None, :] <= pos) & mask[:, None, None, :]  # (B, 1, S_q, n)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no visible key -> 0
    out = torch.einsum("bhqk,bhkd->bqhd", probs, v)  # (B, S_q, Hq, D)
    return out * mask[:, n - seq :, None, None]  # padded queries -> 0


@pytest.mark.parametrize("n", [9, 7])  # 9: every key slot used; 7: two unused slots of a static cache
def test_past_keys_match_the_masked_oracle_with_gradients(n):
    g = torch.Generator().manual_seed(43)
    q = torch.randn(4, 4, 3, 8, generator=g, requires_grad=True)  # 3 queries: the last 3 of n positions
    k = torch.randn(4, 2, 9, 8, generator=g, requires_grad=True)
    v = torch.randn(4, 2, 9, 8, generator=g, requires_grad=True)
    mask = torch.ones(4, n, dtype=torch.bool)
    mask[0, :4] = False  # left padding (what generate passes)
    mask[1, 2] = False  # a hole
    mask[2, :] = False
    mask[2, :3] = True  # valid keys but every query is padding: the row drops out, output 0
    # row 3: no padding
    out, _ = distca_attention_forward(_module(), q, k, v, mask, scaling=0.3)
    want = masked_oracle(q, k, v, mask, 0.3)
    rtol, atol = TOL["fp32"]
    torch.testing.assert_close(out.double(), want, rtol=rtol, atol=atol)
    assert out[2].abs().max() == 0 and out[0].abs().min() > 0
    w = torch.randn(out.shape, generator=g)
    got_grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * w.double()).sum(), (q, k, v))
    for got, ref in zip(got_grads, want_grads):
        torch.testing.assert_close(got.double(), ref.double(), rtol=rtol, atol=atol)
    assert (
        float(got_grads[1][:, :, n:].abs().sum() + got_grads[2][:, :, n:].abs().sum()) == 0.0
    )  # unused slots


def test_past_keys_without_mask_are_bottom_right_causal():
    g = torch.Generator().manual_seed(47)
    q, k, v = (
        torch.randn(2, 4, 2, 8, generator=g),
        torch.randn(2, 2, 6, 8, generator=g),
        torch.randn(2, 2, 6, 8, generator=g),
    )
    out, _ = distca_attention_forward(_module(), q, k, v, None)
    want = masked_oracle(q, k, v, torch.ones(2, 6, dtype=torch.bool), 8**-0.5)
    torch.testing.assert_close(out.double(), want, rtol=TOL["fp32"][0], atol=TOL["fp32"][1])


def test_padding_mask_function_with_a_cache():
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    # dynamic cache: 3 past + 1 new token, the mask covers all 4
    got = distca_padding_mask(2, 1, 4, q_offset=3, attention_mask=mask)
    assert got.tolist() == [[False, True, True, True], [True, True, True, True]]
    assert distca_padding_mask(2, 1, 4, q_offset=3, attention_mask=torch.ones(2, 4)) is None
    # static cache of 10 slots, 4 tokens so far: the mask keeps its width, no mask -> all-true of width 4
    assert distca_padding_mask(2, 1, 10, q_offset=3, attention_mask=mask).shape == (2, 4)
    assert distca_padding_mask(2, 1, 10, q_offset=3, attention_mask=None).tolist() == [[True] * 4] * 2
    assert distca_padding_mask(2, 4, 4, q_offset=0, attention_mask=None) is None
    window = types.SimpleNamespace(sliding_window=8)
    with pytest.raises(
        UnsupportedFeatureError, match="holds keys from position 1 on.*generate past the window"
    ):
        distca_padding_mask(1, 1, 8, q_offset=8, kv_offset=1, config=window)
    with pytest.raises(UnsupportedFeatureError, match="holds keys from position 2 on"):
        distca_padding_mask(1, 1, 8, q_offset=9, kv_offset=2, config=types.SimpleNamespace())


def test_past_keys_refusals():
    q, k, v = _qkv(seq=2, kv_seq=6)
    with pytest.raises(ValueError, match=r"must be \(batch, n\) with 2 <= n <= 6"):
        distca_attention_forward(_module(), q, k, v, torch.ones(1, 7, dtype=torch.bool))
    cu = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="4 past keys"):
        distca_attention_forward(_module(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    layout = types.SimpleNamespace(pieces=[(0, 0, 2)], all_pieces=[[(0, 0, 2)]])
    module = _module()
    enable_distca(module)
    with pytest.raises(ValueError, match="use_cache=False"):
        distca_attention_forward(module, q, k, v, None, distca_layout=layout)


def left_padded_prompts(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths, left-padded to the longest (what generate expects)."""
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, doc in enumerate(random_docs(lengths, seed=seed)):
        ids[row, width - len(doc) :] = torch.tensor(doc)
        mask[row, width - len(doc) :] = 1
    return ids, mask


def greedy(model, attn: str, max_new_tokens: int = 8, **inputs):
    model.set_attn_implementation(attn)
    with torch.no_grad():
        return model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_matches_sdpa_token_for_token(cache):
    model = tiny_model("llama", eos_token_id=None, pad_token_id=0)
    model.eval()
    ids, mask = left_padded_prompts([7, 3, 12, 1], seed=53)
    prompts = [{"input_ids": ids, "attention_mask": mask}, {"input_ids": ids[2:3]}]  # batch 4 padded; 1 alone
    for inputs in prompts:
        want = greedy(model, "sdpa", cache_implementation=cache, **inputs)
        got = greedy(model, "distca", cache_implementation=cache, **inputs)
        assert got.sequences.shape == (inputs["input_ids"].shape[0], inputs["input_ids"].shape[1] + 8)
        assert torch.equal(got.sequences, want.sequences)
        assert len(got.logits) == 8
        for step_got, step_want in zip(got.logits, want.logits):
            assert_logits_close(step_got, step_want)
    assert len(set(got.sequences[:, -8:].flatten().tolist())) > 4  # not a degenerate repeat of one token

    # a packed training forward after generating is still exact (no state leaks between the paths)
    model.train()
    docs = random_docs(DOC_SETS["mixed"], seed=59)
    ref_logits, ref_grads = per_document_reference(model, docs)
    logits, grads = packed_run(model, docs, **{k: v for k, v in packed_batch(docs).items() if k != "labels"})
    assert_logits_close(logits, ref_logits)
    assert_grads_close(grads, ref_grads)


def test_generate_sliding_window_exact_inside_the_window_refused_beyond():
    model = tiny_model("mistral", sliding_window=16, eos_token_id=None, pad_token_id=0)
    model.eval()
    ids, mask = left_padded_prompts([5, 8], seed=61)
    inputs = {"input_ids": ids, "attention_mask": mask}
    # the last forward attends over 8 prompt positions + 8 generated tokens: the window never cuts
    want = greedy(model, "sdpa", max_new_tokens=9, **inputs)
    got = greedy(model, "distca", max_new_tokens=9, **inputs)
    assert torch.equal(got.sequences, want.sequences)
    for step_got, step_want in zip(got.logits, want.logits):
        assert_logits_close(step_got, step_want)
    model.set_attn_implementation("distca")
    with pytest.raises(UnsupportedFeatureError, match="sliding-window cache"), torch.no_grad():
        model.generate(**inputs, max_new_tokens=10, do_sample=False)


# ---------------------------------------------------------------------------------------------------------
# distributed path: enable_distca + distca_layout


def _layout(pieces_per_rank, rank):
    return types.SimpleNamespace(pieces=pieces_per_rank[rank], all_pieces=pieces_per_rank)


def _rank_inputs(docs, pieces):
    ids = [t for doc, start, n in pieces for t in docs[doc][start : start + n]]
    pos = [p for _, start, n in pieces for p in range(start, start + n)]
    return torch.tensor([ids]), torch.tensor([pos])


def _global_rows(docs, pieces):
    """Rows of this rank's tokens in the concatenation of all documents."""
    offsets = [0]
    for d in docs:
        offsets.append(offsets[-1] + len(d))
    return torch.tensor([offsets[doc] + start + i for doc, start, n in pieces for i in range(n)])


def test_enable_distca_warns_when_model_does_not_use_distca():
    model = tiny_model("llama", attn="sdpa")
    with pytest.warns(UserWarning, match=r"set_attn_implementation\('distca'\)"):
        enable_distca(model)


def test_distributed_path_single_process_with_windows():
    """One process, a layout cutting a Gemma 3 document into pieces: local and global layers exact."""
    docs = random_docs([70, 9, 41], seed=29)
    model = tiny_model("gemma3")
    ref_logits, ref_grads = per_document_reference(model, docs)
    model.set_attn_implementation("distca")
    enable_distca(model, config=DistCAConfig(shard_tokens=8))
    pieces = [[(0, 0, 20), (1, 0, 9), (0, 20, 50), (2, 0, 41)]]
    ids, pos = _rank_inputs(docs, pieces[0])
    rows = _global_rows(docs, pieces[0])
    logits = model(input_ids=ids, position_ids=pos, distca_layout=_layout(pieces, 0), use_cache=False).logits
    assert_logits_close(logits[0].detach(), ref_logits[0, rows])


def test_layout_without_runtime_raises_in_model():
    model = tiny_model("llama")
    pieces = [[(0, 0, 6)]]
    with pytest.raises(RuntimeError, match="enable_distca"):
        model(input_ids=torch.randint(0, 128, (1, 6)), distca_layout=_layout(pieces, 0))


def test_distributed_path_single_process():
    """One process, group=None: a layout that cuts a document into two local pieces gives the oracle."""
    docs = random_docs([30, 9, 41], seed=23)
    model = tiny_model("llama")
    ref_logits, ref_grads = per_document_reference(model, docs)
    model.set_attn_implementation("distca")
    runtime = enable_distca(model, config=DistCAConfig(shard_tokens=8))
    assert all(m.distca_runtime is runtime for m in model.modules())
    assert copy.deepcopy(model).model.layers[0].self_attn.distca_runtime is runtime
    pieces = [[(0, 0, 12), (0, 12, 18), (1, 0, 9), (2, 0, 41)]]
    ids, pos = _rank_inputs(docs, pieces[0])
    logits = model(input_ids=ids, position_ids=pos, distca_layout=_layout(pieces, 0), use_cache=False).logits
    split = logits[0].split([len(d) for d in docs])
    (sum(doc_loss_sum(lg, d) for lg, d in zip(split, docs)) / n_labels(docs)).backward()
    assert_logits_close(logits.detach(), ref_logits)
    assert_grads_close(grads_of(model), ref_grads)


def _two_rank_worker(rank: int, world: int, docs, pieces_per_rank, local_docs_per_rank):
    import torch.distributed as dist

    # 1. without enable_distca, each rank computes its own batch and never communicates (the ranks
    #    hold different numbers of documents, so a stray collective would fail or hang)
    model = tiny_model("llama")
    local_docs = local_docs_per_rank[rank]
    with torch.no_grad():
        local = model(**{k: v for k, v in packed_batch(local_docs).items() if k != "labels"}).logits

    # 2. with enable_distca and a layout, documents cut across ranks match the single-process oracle
    runtime = enable_distca(model, group=dist.group.WORLD, config=DistCAConfig(shard_tokens=8, tolerance=0.0))
    assert copy.deepcopy(model).model.layers[0].self_attn.distca_runtime is runtime
    pieces = pieces_per_rank[rank]
    ids, pos = _rank_inputs(docs, pieces)
    logits = model(
        input_ids=ids, position_ids=pos, distca_layout=_layout(pieces_per_rank, rank), use_cache=False
    )
    logits = logits.logits  # (1, T_rank, V)
    weights = torch.randn(sum(map(len, docs)), 128, generator=torch.Generator().manual_seed(29))  # (T, V)
    (logits[0] * weights[_global_rows(docs, pieces)]).sum().backward()
    grads = grads_of(model)
    for g in grads.values():
        dist.all_reduce(g)
    return {"local": local, "logits": logits.detach(), "grads": grads}


def test_two_processes_local_and_distributed():
    docs = random_docs([40, 25, 9], seed=31)
    # rank 0 holds the head of document 0 and document 2; rank 1 the tail of document 0 and document 1
    pieces_per_rank = [[(0, 0, 20), (2, 0, 9)], [(0, 20, 20), (1, 0, 25)]]
    local_docs_per_rank = [random_docs([5, 11], seed=37), random_docs([3, 4, 20], seed=41)]
    results = run_distributed(_two_rank_worker, 2, docs, pieces_per_rank, local_docs_per_rank, timeout=240.0)

    model = tiny_model("llama")
    with torch.no_grad():
        for rank in range(2):
            want = model(
                **{k: v for k, v in packed_batch(local_docs_per_rank[rank]).items() if k != "labels"}
            )
            assert_logits_close(results[rank]["local"], want.logits)

    # oracle: every document alone under SDPA, the same linear functional of the logits
    model.set_attn_implementation("sdpa")
    ref = torch.cat([model(input_ids=torch.tensor([d]), use_cache=False).logits[0] for d in docs])  # (T, V)
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(29))
    (ref * weights).sum().backward()
    ref_grads = grads_of(model)
    for rank in range(2):
        rows = _global_rows(docs, pieces_per_rank[rank])
        assert_logits_close(results[rank]["logits"][0], ref[rows].detach())
        assert_grads_close(results[rank]["grads"], ref_grads)


def test_package_exports():
    assert hf_distca.distca_attention_forward is distca_attention_forward
    assert hf_distca.enable_distca is enable_distca
    assert {"distca_attention_forward", "enable_distca"} <= set(hf_distca.__all__)
    assert math.isfinite(DistCAConfig().balance_tolerance)


def _windowed_worker(rank: int, world: int, cases):
    import torch.distributed as dist

    out = []
    for arch, docs, pieces_per_rank in cases:
        model = tiny_model(arch, **WINDOWED[arch])
        enable_distca(model, group=dist.group.WORLD, config=DistCAConfig(shard_tokens=8, tolerance=0.0))
        pieces = pieces_per_rank[rank]
        ids, pos = _rank_inputs(docs, pieces)
        logits = model(
            input_ids=ids, position_ids=pos, distca_layout=_layout(pieces_per_rank, rank), use_cache=False
        ).logits  # (1, T_rank, V)
        weights = torch.randn(sum(map(len, docs)), 128, generator=torch.Generator().manual_seed(43))  # (T, V)
        (logits[0] * weights[_global_rows(docs, pieces)]).sum().backward()
        grads = grads_of(model)
        for g in grads.values():
            dist.all_reduce(g)
        out.append({"logits": logits.detach(), "grads": grads})
    return out


def test_windowed_models_cut_over_three_processes():
    """Mistral (every layer window 16) and Gemma 3 (5 local layers of window 16, 1 global) on 3 gloo ranks:
    documents of 50-70 tokens cut over all ranks, shards whose windows reach into other ranks' pieces.
    Every rank's logits and the summed parameter gradients equal SDPA run per document."""
    docs = random_docs([70, 9, 55, 3], seed=47)
    pieces_per_rank = [
        [(0, 0, 30), (2, 40, 15)],  # rank 0: head of doc 0, tail of doc 2
        [(0, 30, 25), (1, 0, 9), (3, 0, 3)],
        [(0, 55, 15), (2, 0, 40)],  # tail of doc 0 (its window reaches into rank 1's piece)
    ]
    cases = [(arch, docs, pieces_per_rank) for arch in ("mistral", "gemma3")]
    results = run_distributed(_windowed_worker, 3, cases, timeout=300.0)
    for i, (arch, _, _) in enumerate(cases):
        model = tiny_model(arch, attn="sdpa", **WINDOWED[arch])
        ref = torch.cat(
            [model(input_ids=torch.tensor([d]), use_cache=False).logits[0] for d in docs]
        )  # (T, V)
        weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(43))
        (ref * weights).sum().backward()
        ref_grads = grads_of(model)
        for rank in range(3):
            rows = _global_rows(docs, pieces_per_rank[rank])
            assert_logits_close(results[rank][i]["logits"][0], ref[rows].detach())
            assert_grads_close(results[rank][i]["grads"], ref_grads)
