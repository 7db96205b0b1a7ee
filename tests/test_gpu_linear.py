"""The GPU local part of sequence-parallel linear attention against the float64 per-token reference: the
chunked PyTorch backend and flash-linear-attention's chunk kernels, in float32, for every transition family
(no decay, per-head constant, per-token scalar, per key-dim, delta rule, delta rule with per key-dim
gates): outputs, final states and the gradients of q, k, v, beta, the per-token gates and the entering
state, three packed documents (one over two chunks) and a non-zero entering state (what All-Scan hands a
piece); and Qwen3-Next's replaced gated DeltaNet layer on each backend against the same layer on the
float64 reference, with a document in three out-of-order pieces (state scan and conv halo inside one
process). Skipped without CUDA; the fla cases without fla-core, and, each with fla_unsafe_reason's text,
where fla-core would get that transition wrong on this GPU and Triton (its gated chunk_bwd_dqkwg on
Hopper with Triton >= 3.4.0 and < 3.7.1). Small shapes: the time goes to compiling fla's kernels.
"""

from __future__ import annotations

import pytest
import torch
from all_scan_cases import random_transition
from tolerances import TOL

from hf_distca.linear.ops import recurrence
from hf_distca.linear.ops.fla_backend import fla_available, fla_stalled_reason_on, fla_unsafe_reason_on

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
needs_fla = pytest.mark.skipif(not fla_available(), reason="needs fla-core (pip install -e .[fla])")

HEADS, DK, DV = 2, 64, 64
LENGTHS = [50, 130, 77]
KINDS = ("none", "const", "scalar", "vector", "delta", "kda")


def _inputs(kind: str, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    k = randn(total, HEADS, DK)
    k = k / k.norm(dim=-1, keepdim=True)  # unit-norm keys keep the delta rule contractive
    decay, beta = random_transition(kind, total, HEADS, DK, gen, key_dim_decay=0.1)
    return {
        "q": randn(total, HEADS, DK) * DK**-0.5,
        "k": k,
        "v": randn(total, HEADS, DV),
        "log_decay": decay,
        "beta": beta,
        "h0": 0.1 * randn(len(LENGTHS), HEADS, DK, DV),
        "w_out": randn(total, HEADS, DV),
        "w_state": randn(len(LENGTHS), HEADS, DK, DV),
    }


def _run(backend: str, inputs: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, dict]:
    leaves = {
        n: inputs[n].to("cuda", dtype).detach().requires_grad_(True)
        for n in ("q", "k", "v", "beta", "h0")
        if inputs[n] is not None
    }
    decay = inputs["log_decay"]
    if decay is not None:
        decay = decay.to("cuda", torch.float64 if dtype == torch.float64 else torch.float32).detach()
        if decay.dim() > 1:  # per-token gates are activations with gradients; a per-head constant is fixed
            leaves["log_decay"] = decay.requires_grad_(True)
    cu = [0]
    for n in LENGTHS:
        cu.append(cu[-1] + n)
    out, final = recurrence(
        leaves["q"],
        leaves["k"],
        leaves["v"],
        cu_seqlens=cu,
        log_decay=decay,
        beta=leaves.get("beta"),
        initial_state=leaves["h0"],
        output_final_state=True,
        backend=backend,
    )
    loss = (out.double() * inputs["w_out"].cuda()).sum() + (final.double() * inputs["w_state"].cuda()).sum()
    loss.backward()
    return out.detach(), final.detach(), {n: t.grad for n, t in leaves.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _skip_unsafe_fla(kind: str) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    reason = fla_unsafe_reason_on(device, kind, torch.float32)
    if reason is not None:
        pytest.skip(f"fla-core is unsafe for {kind!r} here ('auto' runs 'chunked'): {reason}")
    stalled = fla_stalled_reason_on(device, kind)
    if stalled is not None:  # keeps this file within its 3 minutes; 'auto' does not run these kernels here
        pytest.skip(f"fla-core's kernel for {kind!r} is not started here ('auto' runs 'chunked'): {stalled}")


def _check(backend: str, kind: str, tol: str) -> None:
    inputs = _inputs(kind)
    ref_out, ref_final, ref_grads = _run("reference", inputs, torch.float64)
    out, final, grads = _run(backend, inputs, torch.float32)
    rtol = TOL[tol][0]
    assert _rel(out, ref_out) <= rtol, ("out", _rel(out, ref_out))
    assert _rel(final, ref_final) <= rtol, ("final state", _rel(final, ref_final))
    assert set(grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        assert _rel(grads[name], ref) <= rtol, (f"d{name}", _rel(grads[name], ref))


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_matches_the_reference_on_cuda(kind):
    _check("chunked", kind, "gpu_linear_chunked")


@pytest.mark.parametrize("backend", ["auto", "chunked", pytest.param("fla", marks=needs_fla)])
def test_qwen3_next_layer_matches_the_reference(backend):
    from all_scan_cases import tiny_qwen3_next

    from hf_distca.data.loader import DistCALayout
    from hf_distca.linear import LinearSPConfig
    from hf_distca.linear.layers import enable_linear_attention_sp

    if backend == "fla":
        _skip_unsafe_fla("delta")
    pieces = ((0, 0, 60), (1, 0, 50), (0, 90, 40), (2, 0, 77), (0, 60, 30))  # document 0 in three pieces
    layout = DistCALayout(pieces=pieces, all_pieces=(pieces,))
    total, hidden_size = sum(n for _, _, n in pieces), 64
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, total, hidden_size, generator=gen, dtype=torch.float64)
    weights = torch.randn(1, total, hidden_size, generator=gen, dtype=torch.float64)
    results = {}
    for name, dtype in ((backend, torch.float32), ("reference", torch.float64)):
        model = tiny_qwen3_next(
            "sdpa", dtype=dtype, hidden_size=hidden_size, linear_key_head_dim=64, linear_value_head_dim=64
        ).cuda()
        enable_linear_attention_sp(model, config=LinearSPConfig(backend=name))
        layer = model.model.layers[0].linear_attn
        # 'auto': fla where fla-core is correct for the gated delta rule on this GPU, else chunked
        assert layer.linear_sp_backend == name or (
            name == "auto" and layer.linear_sp_backend in ("fla", "chunked")
        )
        x = hidden.to("cuda", dtype).requires_grad_(True)
        out = layer(x, distca_layout=layout)
        (out.double() * weights.cuda()).sum().backward()
        results[name] = {
            "out": out.detach(),
            "dx": x.grad,
            **{n: p.grad for n, p in layer.named_parameters()},
        }
    rtol = TOL["gpu_linear"][0]
    for name, ref in results["reference"].items():
        assert _rel(results[backend][name], ref) <= rtol, (name, _rel(results[backend][name], ref))


@needs_fla
@pytest.mark.parametrize("kind", KINDS)
def test_fla_chunk_kernels_match_the_reference(kind):
    _skip_unsafe_fla(kind)
    _check("fla", kind, "gpu_linear")
