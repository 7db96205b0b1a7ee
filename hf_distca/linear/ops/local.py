"""Per-rank parts of sequence-parallel linear attention: the backend choice, the recurrence over local pieces,
the transition of a whole piece, and the contribution of a state that a piece starts from.

Everything here is differentiable and local (no communication). With ``S_loc`` the final state of a piece
run from zero and ``A`` its transition, the state leaving the piece when it starts from ``S_in`` is
``A S_in + S_loc``, and its outputs are ``o_loc + o(S_in)``, where ``o(S_in)`` is the output of the same
recurrence run with zero values from ``S_in`` (both recurrences are linear in (state, values)).

Backends: 'reference' (per-token loop), 'chunked' (chunks of 64 tokens in PyTorch), 'fla'
(flash-linear-attention's kernels, CUDA) and 'auto': fla on CUDA when it imports and is correct for the
transition on this device (:func:`hf_distca.linear.ops.fla_backend.fla_unsafe_reason`), else chunked;
reference on CPU. :func:`prepare_backend` makes the same choice when a model is prepared, so that an
explicit 'fla' that cannot run fails there rather than in the first backward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hf_distca.linear.config import LINEAR_BACKENDS
from hf_distca.linear.ops.chunked import run_chunked
from hf_distca.linear.ops.fla_backend import (
    FLA_FIX,
    fla_available,
    fla_kind,
    fla_stalled_reason_on,
    fla_unsafe_reason_on,
    run_fla,
)
from hf_distca.linear.ops.recurrence import Recurrence, check_offsets, check_recurrence_inputs, run_reference

__all__ = [
    "prepare_backend",
    "piece_transitions",
    "recurrence",
    "resolve_linear_backend",
    "state_contribution",
]

_RECURRENCES = {"reference": run_reference, "chunked": run_chunked, "fla": run_fla}


def resolve_linear_backend(
    backend: str, device: torch.device, *, kind: str | None = None, dtype: torch.dtype | None = None
) -> str:
    """The concrete backend ('reference', 'chunked' or 'fla') for ``backend`` on ``device``.

    ``kind``: the transition (one of ``fla_backend.FLA_KINDS``, see ``fla_kind``; None: any), ``dtype``:
    q's dtype. 'auto' is 'reference' off CUDA; on CUDA 'fla' when fla imports and is correct for ``kind``
    on this device (``fla_unsafe_reason``) and its kernel is known to start there (``fla_stalled_reason``),
    else 'chunked'. An explicit 'fla' that would be wrong raises a ValueError.
    """
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear-attention backend must be one of {LINEAR_BACKENDS}, got {backend!r}")
    if device.type != "cuda":
        return "reference" if backend == "auto" else backend
    if backend == "auto":
        safe = fla_available() and fla_unsafe_reason_on(device, kind, dtype) is None
        return "fla" if safe and fla_stalled_reason_on(device, kind) is None else "chunked"
    if backend == "fla":
        reason = fla_unsafe_reason_on(device, kind, dtype)
        if reason is not None:
            raise ValueError(
                f"backend='fla' cannot run the {kind or 'gated'} transition here: {reason}. {FLA_FIX}"
            )
    return backend


def prepare_backend(backend: str, kind: str | None, dtype: torch.dtype | None = None) -> str:
    """Resolve ``backend`` for the device training will run on (the current CUDA device, else CPU) when a
    model is prepared: an explicit 'fla' that is missing or wrong there raises now. Returns the concrete
    backend."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    name = resolve_linear_backend(backend, device or torch.device("cpu"), kind=kind, dtype=dtype)
    if name == "fla" and device is not None and not fla_available():
        raise ImportError("backend='fla' needs flash-linear-attention: pip install fla-core (and triton)")
    return name


def recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens: Sequence[int],
    log_decay: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    backend: str = "auto",
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The recurrence over packed sequences (the math: :mod:`hf_distca.linear.ops.recurrence`) with the
    chosen backend (:func:`resolve_linear_backend`); inputs are checked here, once, for every backend.

    q, k: (T, H, K); v: (T, H, V); log_decay: None, (H,), (T, H) or (T, H, K); beta: None or (T, H);
    cu_seqlens: host offsets of the N packed sequences; initial_state: (N, H, K, V) or None (zeros).
    Returns o (T, H, V) and, if asked, the final states (N, H, K, V). 'reference' is the per-token loop
    (the oracle: differentiable, any device, computes in the inputs' dtype); 'chunked' returns o in the
    inputs' dtype and final states in float32 at least, and takes ``chunk_size`` (tokens per chunk, default
    64; only for 'chunked').
    """
    check_recurrence_inputs(q, k, v, log_decay, beta)
    t, h, kd = q.shape
    bounds = check_offsets(cu_seqlens, t, initial_state, (h, kd, v.shape[-1]))
    call = Recurrence(q, k, v, bounds, log_decay, beta, scale, initial_state, output_final_state)
    name = resolve_linear_backend(backend, q.device, kind=fla_kind(log_decay, beta), dtype=q.dtype)
    if chunk_size is None:
        return _RECURRENCES[name](call)
    if name != "chunked":
        raise ValueError(f"chunk_size applies to backend='chunked' only, not to {name!r}; drop it")
    return run_chunked(call, chunk_size)


def _gather_runs(x: torch.Tensor | None, runs: Sequence[tuple[int, int]]) -> torch.Tensor | None:
    """Rows [start, start + length) of x for every run, concatenated: (sum of lengths, ...)."""
    if x is None:
        return None
    return torch.cat([x[s : s + n] for s, n in runs]) if runs else x[:0]


def _cu(runs: Sequence[tuple[int, int]]) -> list[int]:
    cu = [0]
    for _, n in runs:
        cu.append(cu[-1] + n)
    return cu


def _from_state_alone(
    q: torch.Tensor,
    k: torch.Tensor,
    runs: Sequence[tuple[int, int]],
    initial_state: torch.Tensor,
    log_decay: torch.Tensor | None,
    beta: torch.Tensor | None,
    scale: float,
    output_final_state: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The recurrence over the runs (local row start, length) with zero values, from ``initial_state``
    (N, H, K, W): what the state alone contributes. Returns o (sum of lengths, H, W) in run order and, if
    asked, the final states (N, H, K, W)."""
    rows_q, rows_k = _gather_runs(q, runs), _gather_runs(k, runs)
    h, width = initial_state.shape[1], initial_state.shape[-1]
    zeros = rows_k.new_zeros((rows_k.shape[0], h, width))  # (T_runs, H, W)
    return recurrence(
        rows_q,
        rows_k,
        zeros,
        cu_seqlens=_cu(runs),
        log_decay=log_decay if log_decay is None or log_decay.dim() == 1 else _gather_runs(log_decay, runs),
        beta=_gather_runs(beta, runs),
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        backend=backend,
    )


def piece_transitions(
    q: torch.Tensor,
    k: torch.Tensor,
    runs: Sequence[tuple[int, int]],
    *,
    log_decay: torch.Tensor | None,
    beta: torch.Tensor | None,
    state_dtype: torch.dtype,
    backend: str = "auto",
) -> torch.Tensor:
    """Transition of each run (local row start, length): the map from the state entering the run to the
    state leaving it, without the run's own key/values.

    Returns (N, H) per-head factors ('scalar'), (N, H, K) per key-dim factors ('vector') or (N, H, K, K)
    matrices ('dense', the delta rule; computed by running the recurrence with zero values from the
    identity, column by column).
    """
    t, h, kd = k.shape
    if beta is None:
        if log_decay is None:
            return k.new_ones((len(runs), h), dtype=state_dtype)
        if log_decay.dim() == 1:
            lengths = torch.tensor([n for _, n in runs], dtype=log_decay.dtype, device=log_decay.device)
            return (lengths[:, None] * log_decay[None, :]).exp().to(state_dtype)  # (N, H)
        sums = [log_decay[s : s + n].sum(0) for s, n in runs]  # (H,) or (H, K) each
        if not sums:
            return log_decay.new_zeros((0, *log_decay.shape[1:]), dtype=state_dtype)
        return torch.stack(sums).exp().to(state_dtype)  # (N, H[, K])
    eye = torch.eye(kd, dtype=state_dtype, device=k.device).expand(len(runs), h, kd, kd)  # (N, H, K, K)
    _, final = _from_state_alone(q, k, runs, eye, log_decay, beta, 1.0, True, backend)
    return final.to(state_dtype)  # (N, H, K, K)


def state_contribution(
    q: torch.Tensor,
    k: torch.Tensor,
    runs: Sequence[tuple[int, int]],
    states: torch.Tensor,
    *,
    log_decay: torch.Tensor | None,
    beta: torch.Tensor | None,
    scale: float,
    backend: str = "auto",
) -> torch.Tensor:
    """Output of each run (local row start, length) due only to the state it starts from.

    states: (N, H, K, V). Returns (sum of lengths, H, V) rows in run order. Diagonal decays: a closed
    form, scale * (q_t * exp(cumulative log decay)) S; delta rule: the recurrence with zero values.
    """
    h, vd = states.shape[1], states.shape[-1]
    if not runs:
        return q.new_zeros((0, h, vd))
    if beta is None:
        parts = []
        for (s, n), state in zip(runs, states):
            q_run = q[s : s + n]  # (n, H, K)
            if log_decay is not None:
                if log_decay.dim() == 1:
                    steps = torch.arange(1, n + 1, dtype=log_decay.dtype, device=log_decay.device)
                    cum = steps[:, None] * log_decay[None, :]  # (n, H)
                else:
                    cum = log_decay[s : s + n].cumsum(0)  # (n, H) or (n, H, K)
                decay = cum.exp()
                q_run = q_run * (decay[..., None] if decay.dim() == 2 else decay)
            parts.append(torch.einsum("thk,hkv->thv", q_run.to(state.dtype), state) * scale)  # (n, H, V)
        return torch.cat(parts).to(q.dtype)
    out, _ = _from_state_alone(q, k, runs, states, log_decay, beta, scale, False, backend)
    return out
