"""Shared helpers of the all_scan tests: the per-token float64 oracle, random inputs, layouts, tiny MiniMax.

The oracle is written here, independently of hf_distca.linear: one document at a time, one token at a
time, a (K, V) state per head, in float64.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

H, K, V = 2, 4, 6
KINDS = ("none", "const", "scalar", "vector", "delta", "kda")


def oracle_document(q, k, v, log_decay, beta, scale):
    """One document: q, k (L, H, K), v (L, H, V), log_decay None / (H,) / (L, H) / (L, H, K), beta None / (L, H)."""
    length, heads, kd = q.shape
    state = torch.zeros(heads, kd, v.shape[-1], dtype=q.dtype)
    outs = []
    for t in range(length):
        if log_decay is not None:
            g = log_decay if log_decay.dim() == 1 else log_decay[t]
            factor = g.exp()
            state = state * (factor[:, None, None] if factor.dim() == 1 else factor[:, :, None])
        for h in range(heads):
            kt, vt = k[t, h], v[t, h]
            if beta is not None:
                vt = beta[t, h] * (vt - kt @ state[h])
            state = state.clone()
            state[h] = state[h] + torch.outer(kt, vt)
        outs.append(torch.einsum("hk,hkv->hv", q[t], state) * scale)
    return torch.stack(outs) if outs else v[:0] * 0


def oracle(inputs: dict, doc_lengths: Sequence[int], scale: float):
    """Documents back to back (ids 0, 1, ... in order) -> outputs (T, H, V)."""
    outs, start = [], 0
    for n in doc_lengths:
        sl = slice(start, start + n)
        g = inputs["log_decay"]
        g = None if g is None else (g if g.dim() == 1 else g[sl])
        b = inputs["beta"]
        b = None if b is None else b[sl]
        outs.append(oracle_document(inputs["q"][sl], inputs["k"][sl], inputs["v"][sl], g, b, scale))
        start += n
    return torch.cat(outs)


def random_transition(
    kind: str, total: int, heads: int, key_dim: int, gen: torch.Generator, key_dim_decay: float = 0.3
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """float64 (log_decay, beta) of a transition kind over ``total`` tokens, drawn from ``gen`` (every kind's
    decay is drawn, whichever is asked, so later draws do not depend on it); per key dim decays (vector,
    kda) lie in (-key_dim_decay, 0]."""
    log_decay = {
        "none": None,
        "const": -0.05 - 0.2 * torch.rand(heads, generator=gen, dtype=torch.float64),
        "scalar": -0.3 * torch.rand(total, heads, generator=gen, dtype=torch.float64),
        "vector": -key_dim_decay * torch.rand(total, heads, key_dim, generator=gen, dtype=torch.float64),
        "delta": -0.3 * torch.rand(total, heads, generator=gen, dtype=torch.float64),
        "kda": -key_dim_decay * torch.rand(total, heads, key_dim, generator=gen, dtype=torch.float64),
    }[kind]
    beta = torch.rand(total, heads, generator=gen, dtype=torch.float64) if kind in ("delta", "kda") else None
    return log_decay, beta


def random_inputs(kind: str, total: int, seed: int, dtype=torch.float64) -> dict:
    """Global inputs in document order (same in every process for the same seed); keys unit-norm so the
    delta rule stays contractive; ``w`` weighs the outputs in the loss sum(o * w)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v, w = randn(total, H, K), randn(total, H, K), randn(total, H, V), randn(total, H, V)
    if kind in ("delta", "kda"):
        k = k / k.norm(dim=-1, keepdim=True)
    log_decay, beta = random_transition(kind, total, H, K, gen)
    out = {"q": q, "k": k, "v": v, "w": w, "log_decay": log_decay, "beta": beta}
    return {name: (t.to(dtype) if t is not None else None) for name, t in out.items()}


def doc_lengths_of(all_pieces) -> list[int]:
    """Length of every document id 0..max in a layout (padding pseudo-documents included)."""
    ends: dict[int, int] = {}
    for pieces in all_pieces:
        for doc, start, n in pieces:
            ends[doc] = max(ends.get(doc, 0), start + n)
    return [ends.get(d, 0) for d in range(max(ends) + 1)]


def rank_rows(all_pieces, rank: int) -> torch.Tensor:
    """Rows of ``rank``'s local tokens in the concatenation of all documents (ids in order)."""
    lengths = doc_lengths_of(all_pieces)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    rows = [torch.arange(offsets[d] + s, offsets[d] + s + n) for d, s, n in all_pieces[rank]]
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)


def per_token(x: torch.Tensor | None, total: int) -> bool:
    return x is not None and x.dim() >= 2 and x.shape[0] == total


# ---------------------------------------------------------------------------------------- tiny hybrids
def _tiny_hybrid_fields(vocab_size: int, deltanet: bool, **fields) -> dict:
    """Config fields of a tiny 3-layer hybrid (linear, full, linear attention), with gated DeltaNet linear
    layers (Qwen3-Next, OLMo-hybrid: conv kernel 4, 2 value heads per key head) when ``deltanet``, plus
    ``fields``."""
    shared = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        max_position_embeddings=4096,
        use_cache=False,
        initializer_range=0.2,
        **fields,
    )
    if deltanet:
        shared.update(
            linear_conv_kernel_dim=4,
            linear_key_head_dim=8,
            linear_value_head_dim=6,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
        )
    return shared


# ----------------------------------------------------------------------------------------- tiny MiniMax
MINIMAX_VOCAB = 64


def tiny_minimax(attn_implementation: str, dtype=torch.float64, seed: int = 0):
    """A 3-layer MiniMax (linear, full, linear attention; 2 experts, both used), random init, CPU."""
    from transformers import AutoModelForCausalLM, MiniMaxConfig

    config = MiniMaxConfig(
        **_tiny_hybrid_fields(
            MINIMAX_VOCAB, False, head_dim=8, num_local_experts=2, num_experts_per_tok=2, block_size=16
        )
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation, experts_implementation="eager"
    )
    return model.to(dtype)


def minimax_documents(lengths: Sequence[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, MINIMAX_VOCAB, (n,), generator=gen).tolist() for n in lengths]


# ------------------------------------------------------------------------------------- tiny Qwen3-Next
QWEN3_NEXT_VOCAB = 64


def tiny_qwen3_next(attn_implementation: str, dtype=torch.float64, seed: int = 0, **overrides):
    """A 3-layer Qwen3-Next (gated DeltaNet, full attention, gated DeltaNet; conv kernel 4; 2 value heads per
    key head; MoE with 2 experts, both used, plus the shared expert), random init, CPU; ``overrides``
    replace config fields."""
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    fields = _tiny_hybrid_fields(
        QWEN3_NEXT_VOCAB,
        True,
        head_dim=8,
        num_experts=2,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    )
    config = Qwen3NextConfig(**{**fields, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation, experts_implementation="eager"
    )
    # slower decays than Qwen3-Next's init (A up to 16): the state keeps O(0.1) entries over tens of
    # tokens, so the gated RMS norm of its read-out does not amplify float32 rounding
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                a_log = layer.linear_attn.A_log
                a_log.copy_(torch.empty(a_log.shape).uniform_(0.02, 0.5, generator=gen).log())
    return model.to(dtype)


def qwen3_next_documents(lengths: Sequence[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed + 1000)
    return [torch.randint(0, QWEN3_NEXT_VOCAB, (n,), generator=gen).tolist() for n in lengths]


# ------------------------------------------------------------------------------------ tiny OLMo-hybrid
def tiny_olmo_hybrid(attn_implementation: str, dtype=torch.float64, seed: int = 0, **overrides):
    """A 3-layer OLMo-hybrid (gated DeltaNet, full attention, gated DeltaNet; conv kernel 4; 2 value heads
    per key head; beta doubled: ``linear_allow_neg_eigval``), random init, CPU; ``overrides`` replace config
    fields. Decays drawn as slow as the tiny Qwen3-Next's (A in [0.02, 0.5])."""
    from transformers import AutoModelForCausalLM, OlmoHybridConfig

    fields = _tiny_hybrid_fields(
        QWEN3_NEXT_VOCAB,
        True,
        linear_a_log_min=0.02,
        linear_a_log_max=0.5,
        linear_allow_neg_eigval=True,
        pad_token_id=0,
        eos_token_id=1,
    )
    config = OlmoHybridConfig(**{**fields, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.to(dtype)
