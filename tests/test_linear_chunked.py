"""The chunked PyTorch recurrences (hf_distca.linear.ops.chunked) and the choice of the local backend.

CPU, one process:
- chunked vs the per-token reference in float64 for every transition kind: several packed documents whose
  lengths are not multiples of the chunk (1, shorter than a chunk, exactly one, more than two, empty), a
  non-zero entering state; outputs, final states and the gradients of q, k, v, beta, the gates and the
  entering state; strong gates (log decay about -5 per token) stay finite and exact; per-key-dim gates
  built a group of chunks at a time and recomputed in backward; float32 / bfloat16 inputs;
- fla-core 0.6's rule for its gated chunk_bwd_dqkwg on Hopper (fla_unsafe_reason), table-tested, and what
  'auto' / 'fla' resolve to on a (mocked) CUDA device, at model preparation included;
- a Qwen3-Next gated DeltaNet layer with a document in out-of-order pieces (the state scan in one process)
  on backend='chunked' against backend='reference'.
"""

from __future__ import annotations

import pytest
import torch
from all_scan_cases import KINDS, H, K, V, random_inputs
from tolerances import TOL

import hf_distca.linear.ops.chunked as chunked
import hf_distca.linear.ops.fla_backend as fla_backend
import hf_distca.linear.ops.local as local
from hf_distca.linear import LinearSPConfig
from hf_distca.linear.ops import fla_kind, fla_unsafe_reason, recurrence, resolve_linear_backend

SCALE = 0.5
CHUNK = 8
LENGTHS = [1, 5, 8, 0, 19, 30]  # 1 token, < C, = C, empty, > 2C (not a multiple), > 3C


def _cu(lengths: list[int]) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _recurrence(backend: str, inputs: dict, lengths: list[int], **kw):
    """:func:`recurrence` with ``backend`` of ``inputs`` (q, k, v, log_decay, beta by name; a missing or
    None log_decay/beta: none) over documents of ``lengths``, with scale ``SCALE``."""
    return recurrence(
        inputs["q"],
        inputs["k"],
        inputs["v"],
        cu_seqlens=_cu(lengths),
        log_decay=inputs.get("log_decay"),
        beta=inputs.get("beta"),
        scale=SCALE,
        backend=backend,
        **kw,
    )


def _run(backend: str, inputs: dict, lengths: list[int], h0: torch.Tensor | None, **kw) -> dict:
    """The recurrence with ``backend``: outputs, final states and the gradients of every input of loss = sum(o * w) + sum(final * w_state)."""
    leaves = {
        n: inputs[n].clone().requires_grad_(True)
        for n in ("q", "k", "v", "log_decay", "beta")
        if inputs[n] is not None
    }
    if h0 is not None:
        leaves["h0"] = h0.clone().requires_grad_(True)
    out, final = _recurrence(
        backend, leaves, lengths, initial_state=leaves.get("h0"), output_final_state=True, **kw
    )
    w_state = torch.linspace(-1, 1, final.numel(), dtype=final.dtype).view(final.shape)
    ((out * inputs["w"].to(out.dtype)).sum() + (final * w_state).sum()).backward()
    return {"out": out.detach(), "final": final.detach(), **{"d" + n: x.grad for n, x in leaves.items()}}


def _assert_matches(got: dict, want: dict, label: str, tol: str = "linear_fp64") -> None:
    rtol, atol = TOL[tol]
    assert set(got) == set(want), label
    for name, ref in want.items():
        torch.testing.assert_close(
            got[name].double(), ref, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{label} {n}: {m}"
        )


def _h0(lengths: list[int], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return 0.5 * torch.randn(len(lengths), H, K, V, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_matches_reference_float64(kind):
    inputs = random_inputs(kind, sum(LENGTHS), seed=1)
    h0 = _h0(LENGTHS)
    want = _run("reference", inputs, LENGTHS, h0)
    got = _run("chunked", inputs, LENGTHS, h0, chunk_size=CHUNK)
    _assert_matches(got, want, kind)
    assert (want["out"] - _run("reference", inputs, LENGTHS, None)["out"]).abs().max() > 1e-2  # h0 matters
    # the default chunk (64): a document over two chunks and one inside the first
    lengths = [150, 3, 64]
    inputs = random_inputs(kind, sum(lengths), seed=2)
    _assert_matches(
        _run("chunked", inputs, lengths, _h0(lengths, 1)),
        _run("reference", inputs, lengths, _h0(lengths, 1)),
        f"{kind}, C=64",
    )


@pytest.mark.parametrize("kind", ["const", "scalar", "vector", "delta", "kda"])
def test_chunked_strong_gates_stay_finite_and_exact(kind):
    """Log decays of -5 to -6 per token (exp(-380) across a chunk): exact in float64, finite in float32."""
    lengths = [70, 9]
    inputs = random_inputs(kind, sum(lengths), seed=3)
    inputs["log_decay"] = -5.0 - torch.rand(inputs["log_decay"].shape, dtype=torch.float64)
    h0 = _h0(lengths, 2)
    want = _run("reference", inputs, lengths, h0)
    got = _run("chunked", inputs, lengths, h0)
    _assert_matches(got, want, kind)
    as32 = {n: (x.float() if x is not None else None) for n, x in inputs.items()}
    as32["log_decay"] = as32["log_decay"] * 10  # exp(-3800) over a chunk: underflows to 0, never inf / NaN
    got32 = _run("chunked", as32, lengths, h0.float())
    assert all(bool(torch.isfinite(x).all()) for x in got32.values()), kind


@pytest.mark.parametrize("kind", ["vector", "kda"])
def test_chunked_per_key_dim_pairs_in_groups_recomputed_in_backward(kind, monkeypatch):
    """The (chunks, H, C, C, K) pairwise decays exist for one chunk at a time (budget 1 element), built
    again for each group in backward (activation checkpointing); results unchanged."""
    sizes: list[int] = []
    original = chunked._pairwise_vector

    def recording(q, *args):
        sizes.append(q.shape[0])
        return original(q, *args)

    monkeypatch.setattr(chunked, "_PAIRWISE_ELEMENTS", 1)
    monkeypatch.setattr(chunked, "_pairwise_vector", recording)
    inputs = random_inputs(kind, sum(LENGTHS), seed=4)
    h0 = _h0(LENGTHS, 3)
    got = _run("chunked", inputs, LENGTHS, h0, chunk_size=CHUNK)
    chunks = sum(-(-n // CHUNK) for n in LENGTHS)
    assert sizes == [1] * (2 * chunks), sizes  # forward, then each group once more in backward
    _assert_matches(got, _run("reference", inputs, LENGTHS, h0), kind)
    sizes.clear()
    with torch.no_grad():
        _recurrence("chunked", inputs, LENGTHS, chunk_size=CHUNK)
    assert sizes == [1] * chunks  # no gradients: nothing to recompute


@pytest.mark.parametrize("kind", ["scalar", "delta", "kda"])
def test_chunked_low_precision_inputs(kind):
    """float32 inputs: float32 everywhere, close to the float64 reference; bfloat16 inputs: bfloat16
    outputs, float32 final states (the state is computed in float32)."""
    lengths = [40, 7]
    inputs = random_inputs(kind, sum(lengths), seed=5)
    want = _run("reference", inputs, lengths, None)
    got = _run(
        "chunked",
        {n: (x.float() if x is not None else None) for n, x in inputs.items()},
        lengths,
        None,
    )
    assert got["out"].dtype == got["final"].dtype == torch.float32
    _assert_matches(got, want, kind, tol="fp32")
    bf16 = {n: (x.to(torch.bfloat16) if x is not None and n != "log_decay" else x) for n, x in inputs.items()}
    out, final = _recurrence("chunked", bf16, lengths, output_final_state=True)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    assert float((out.double() - want["out"]).abs().max() / want["out"].abs().max()) < 5e-2


def test_chunked_backend_through_recurrence_and_bad_input():
    inputs = random_inputs("delta", sum(LENGTHS), seed=6)
    args = (inputs["q"], inputs["k"], inputs["v"])
    kw = dict(cu_seqlens=_cu(LENGTHS), log_decay=inputs["log_decay"], beta=inputs["beta"], scale=SCALE)
    out, _ = recurrence(*args, **kw, backend="chunked")
    ref, _ = recurrence(*args, **kw, backend="reference")
    torch.testing.assert_close(out, ref, rtol=TOL["linear_fp64"][0], atol=TOL["linear_fp64"][1])
    with pytest.raises(ValueError, match="chunk_size"):
        recurrence(*args, **kw, backend="chunked", chunk_size=0)
    with pytest.raises(ValueError, match="chunk_size applies to backend='chunked' only"):
        recurrence(*args, **kw, backend="reference", chunk_size=8)
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        recurrence(*args, cu_seqlens=[0, 3], backend="chunked")
    with pytest.raises(ValueError, match="initial_state must be shaped"):
        recurrence(*args, cu_seqlens=_cu(LENGTHS), initial_state=torch.zeros(1, H, K, V), backend="chunked")
    with pytest.raises(ValueError, match="backend must be one of"):
        LinearSPConfig(backend="triton")
    with pytest.raises(ValueError, match="backend must be one of"):
        recurrence(*args, **kw, backend="triton")


# ------------------------------------------------------------------------------ when fla is safe
HOPPER, AMPERE, BLACKWELL = (9, 0), (8, 0), (10, 0)


@pytest.mark.parametrize(
    "kind, capability, triton, tilelang, float32, unsafe",
    [
        # the gated chunk_bwd_dqkwg kinds on Hopper, Triton in [3.4.0, 3.7.1): refused
        ("scalar", HOPPER, "3.6.0", False, False, True),
        *[
            ("delta", HOPPER, triton, False, False, True)
            for triton in ("3.6.0", "3.4.0", "3.7.0", "3.6.0+git1a2b3c")
        ],
        ("delta", (9, 0), "3.5.1", False, True, True),
        # the other kinds never run it (g_gamma, chunk_gla, chunk_kda)
        *[(kind, HOPPER, "3.6.0", False, False, False) for kind in ("none", "const", "vector", "kda")],
        # Triton outside the broken range
        *[("delta", HOPPER, triton, False, False, False) for triton in ("3.3.1", "3.4.0rc1", "3.7.1")],
        ("scalar", HOPPER, "3.8.0", False, False, False),
        # other GPUs, or not an NVIDIA GPU
        ("delta", AMPERE, "3.6.0", False, False, False),
        ("scalar", BLACKWELL, "3.6.0", False, False, False),
        ("delta", (12, 0), "3.6.0", False, False, False),
        ("delta", None, "3.6.0", False, False, False),
        # fla's TileLang backend takes the delta rule; simple_gla's only with float32 q
        ("delta", HOPPER, "3.6.0", True, False, False),
        ("scalar", HOPPER, "3.6.0", True, False, True),
        ("scalar", HOPPER, "3.6.0", True, True, False),
        # None: any kind
        (None, HOPPER, "3.6.0", False, False, True),
        (None, HOPPER, "3.6.0", True, False, True),
        (None, HOPPER, "3.6.0", True, True, False),
        (None, AMPERE, "3.6.0", False, False, False),
    ],
)
def test_fla_unsafe_reason_table(kind, capability, triton, tilelang, float32, unsafe):
    reason = fla_unsafe_reason(
        kind, capability=capability, triton_version=triton, tilelang=tilelang, float32=float32
    )
    assert (reason is not None) == unsafe, reason
    if unsafe:
        assert "3.7.1" in reason and "Hopper" in reason and triton in reason


def test_fla_unsafe_reason_by_device_name_and_bad_kind():
    # fla also counts a GPU named 'NVIDIA H...' as Hopper
    assert fla_unsafe_reason(
        "delta", capability=(8, 9), device_name="NVIDIA H20", triton_version="3.6.0", tilelang=False
    )
    assert not fla_unsafe_reason(
        "delta", capability=(8, 9), device_name="NVIDIA L40S", triton_version="3.6.0", tilelang=False
    )
    with pytest.raises(ValueError, match="fla kind"):
        fla_unsafe_reason("dense", capability=HOPPER, triton_version="3.6.0", tilelang=False)


def test_fla_kind_follows_the_adapter():
    t = 5
    assert fla_kind(None, None) == "none"
    assert fla_kind(torch.zeros(H), None) == "const"
    assert fla_kind(torch.zeros(H, requires_grad=True), None) == "scalar"  # fla gives g_gamma no gradient
    assert fla_kind(torch.zeros(t, H), None) == "scalar"
    assert fla_kind(torch.zeros(t, H, K), None) == "vector"
    assert fla_kind(None, torch.zeros(t, H)) == "delta"
    assert fla_kind(torch.zeros(H), torch.zeros(t, H)) == "delta"
    assert fla_kind(torch.zeros(t, H, K), torch.zeros(t, H)) == "kda"


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA device whose capability, Triton and TileLang the test sets: ``fake_cuda(cap, triton, tilelang)``."""

    def configure(capability=HOPPER, triton="3.6.0", tilelang=False, fla=True):
        monkeypatch.setattr(fla_backend, "_cuda_facts", lambda index: (capability, "NVIDIA GPU"))
        monkeypatch.setattr(fla_backend, "_triton_version", lambda: triton)
        monkeypatch.setattr(fla_backend, "_tilelang_usable", lambda: tilelang)
        monkeypatch.setattr(local, "fla_available", lambda: fla)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        return torch.device("cuda", 0)

    return configure


def test_resolve_backend_auto_and_explicit(fake_cuda):
    cpu = torch.device("cpu")
    assert resolve_linear_backend("auto", cpu, kind="delta") == "reference"  # CPU: the reference
    assert resolve_linear_backend("chunked", cpu) == "chunked"
    assert resolve_linear_backend("fla", cpu) == "fla"  # the fla backend itself refuses CPU tensors
    cuda = fake_cuda(HOPPER, "3.6.0")  # the H200 of issue 15: Triton 3.6 (torch 2.11), no tilelang
    chosen = {kind: resolve_linear_backend("auto", cuda, kind=kind) for kind in KINDS}
    # scalar, delta: fla is wrong there; the others: correct, but fla's first call takes minutes on the H200
    assert chosen == dict.fromkeys(KINDS, "chunked")
    assert resolve_linear_backend("fla", cuda, kind="vector") == "fla"  # asked for explicitly: it runs
    assert resolve_linear_backend("auto", cuda) == "chunked"  # kind unknown: safe for every kind
    assert resolve_linear_backend("chunked", cuda, kind="const") == "chunked"
    assert resolve_linear_backend("reference", cuda, kind="delta") == "reference"
    assert resolve_linear_backend("fla", cuda, kind="const") == "fla"
    with pytest.raises(ValueError, match="backend='chunked'.*3.7.1.*tilelang"):
        resolve_linear_backend("fla", cuda, kind="delta")
    with pytest.raises(ValueError, match="Triton 3.6.0"):
        resolve_linear_backend("fla", cuda, kind="scalar", dtype=torch.bfloat16)
    fake_cuda(HOPPER, "3.7.1")
    assert {resolve_linear_backend("auto", cuda, kind=kind) for kind in KINDS} == {"fla"}
    fake_cuda(HOPPER, "3.6.0", tilelang=True)
    assert resolve_linear_backend("auto", cuda, kind="delta") == "fla"
    assert resolve_linear_backend("auto", cuda, kind="scalar", dtype=torch.bfloat16) == "chunked"
    assert resolve_linear_backend("auto", cuda, kind="scalar", dtype=torch.float32) == "fla"
    fake_cuda(AMPERE, "3.6.0")
    assert {resolve_linear_backend("auto", cuda, kind=kind) for kind in KINDS} == {"fla"}
    fake_cuda(AMPERE, "3.6.0", fla=False)
    assert resolve_linear_backend("auto", cuda, kind="const") == "chunked"  # no fla: chunked on CUDA


def test_model_preparation_picks_the_backend(fake_cuda):
    """enable_linear_attention_sp decides for the current CUDA device: 'auto' -> chunked for the gated
    DeltaNet on the H200 + Triton 3.6, explicit fla for MiniMax's constant decay; an explicit 'fla' that would be
    wrong raises before any module is replaced."""
    from all_scan_cases import tiny_minimax, tiny_qwen3_next

    from hf_distca.linear.layers import Qwen3NextGatedDeltaNetSP, enable_linear_attention_sp

    qwen, qwen_fla, minimax = tiny_qwen3_next("sdpa"), tiny_qwen3_next("sdpa"), tiny_minimax("sdpa")
    fake_cuda(HOPPER, "3.6.0")
    enable_linear_attention_sp(qwen, config=LinearSPConfig(backend="auto"))
    assert [m.linear_sp_backend for m in qwen.modules() if isinstance(m, Qwen3NextGatedDeltaNetSP)] == [
        "chunked"
    ] * 2
    with pytest.raises(ValueError, match="backend='chunked'"):
        enable_linear_attention_sp(qwen_fla, config=LinearSPConfig(backend="fla"))
    assert not any(isinstance(m, Qwen3NextGatedDeltaNetSP) for m in qwen_fla.modules())  # nothing replaced
    with pytest.raises(ValueError, match="backend='chunked'"):  # nor reconfigured
        enable_linear_attention_sp(qwen, config=LinearSPConfig(backend="fla"))
    assert qwen.model.layers[0].linear_attn.linear_sp_config.backend == "auto"
    enable_linear_attention_sp(minimax, config=LinearSPConfig(backend="fla"))
    assert minimax.model.layers[0].self_attn.linear_sp_backend == "fla"
    fake_cuda(HOPPER, "3.7.1")
    enable_linear_attention_sp(qwen, config=LinearSPConfig(backend="fla"))
    assert qwen.model.layers[0].linear_attn.linear_sp_backend == "fla"


def test_chunked_qwen3_next_layer_with_pieces_matches_reference():
    """A replaced gated DeltaNet layer on backend='chunked' with a document in three out-of-order pieces
    (state scan and conv halo inside one process) equals the same layer on backend='reference'."""
    from all_scan_cases import tiny_qwen3_next

    from hf_distca.data.loader import DistCALayout
    from hf_distca.linear.layers import enable_linear_attention_sp

    pieces = ((0, 0, 21), (1, 0, 9), (0, 31, 14), (2, 0, 12), (0, 21, 10))  # document 0 in three pieces
    layout = DistCALayout(pieces=pieces, all_pieces=(pieces,))
    total = sum(n for _, _, n in pieces)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, total, 32, generator=gen, dtype=torch.float64)
    weights = torch.randn(1, total, 32, generator=gen, dtype=torch.float64)
    results = {}
    for backend in ("chunked", "reference"):
        model = tiny_qwen3_next("sdpa")
        enable_linear_attention_sp(model, config=LinearSPConfig(backend=backend))
        layer = model.model.layers[0].linear_attn
        x = hidden.clone().requires_grad_(True)
        out = layer(x, distca_layout=layout)
        (out * weights).sum().backward()
        results[backend] = {
            "out": out.detach(),
            "dx": x.grad,
            **{n: p.grad for n, p in layer.named_parameters()},
        }
    _assert_matches(results["chunked"], results["reference"], "qwen3-next layer", tol="fp32_norms_grads")
