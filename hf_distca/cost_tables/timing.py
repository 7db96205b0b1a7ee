"""Timing the varlen kernel on CA-task shapes: the cells of a cost table (:mod:`hf_distca.cost_tables`).

For every (q_len, kv_len) of a grid with q_len <= kv_len, :func:`time_table` times the kernel on tasks of
q_len queries at the end of a kv_len-token KV prefix (bottom-right causal, the shape of a CA-task),
forward plus backward by default, in seconds per task. Several copies of a short task run fused in one
kernel call (as a server runs all its tasks in one call), so a cell is the marginal time of one task in a
fused call, not the launch latency. The kernels are called as the engine's servers call them
(:func:`~hf_distca.kernels.attention_forward` then :func:`~hf_distca.kernels.attention_backward`, offsets
on the host), outside autograd. On CUDA the time comes from CUDA events; elsewhere from the wall clock
(the ``reference`` kernel on the CPU: only useful to test end to end). :func:`provenance` records where
and how a table was measured. Used by the command line ``python -m hf_distca.calibrate`` and by the
start-up measurement of ``DistCAConfig(cost_table="auto")`` (:mod:`hf_distca.engine.cost_probe`).
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from hf_distca.cost_tables import normalize_dtype
from hf_distca.kernels import attention_backward, attention_forward, resolve_backend
from hf_distca.version import __version__

__all__ = [
    "STARTUP_LENS",
    "STARTUP_REPEATS",
    "STARTUP_WARMUP",
    "device_name",
    "provenance",
    "time_table",
    "time_task",
]

STARTUP_LENS = [128, 512, 2048, 8192, 32768]
"""The start-up grid (q_lens = kv_lens): 15 cells with q_len <= kv_len; longer tasks take the 32K rate,
within ~1% of the 64K one on an H200 (benchmarks/results/cost_tables_h200.md)."""
STARTUP_WARMUP, STARTUP_REPEATS = 2, 5


def time_task(
    q_len: int,
    kv_len: int,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    backend: str,
    backward: bool,
    fuse_tokens: int,
    warmup: int,
    repeats: int,
) -> float:
    """Median seconds of one (q_len, kv_len) task, measured as ``copies`` tasks fused in one kernel call."""
    copies = max(1, fuse_tokens // kv_len)
    gen = torch.Generator(device=device).manual_seed(q_len * 1_000_003 + kv_len)
    q = torch.randn(copies * q_len, heads, head_dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(copies * kv_len, kv_heads, head_dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn_like(k)
    cu_q = torch.arange(copies + 1, dtype=torch.int32) * q_len  # (copies + 1,) on the host, as the engine's
    cu_k = torch.arange(copies + 1, dtype=torch.int32) * kv_len  # (copies + 1,)
    dout = torch.randn_like(q) if backward else None

    def run() -> None:
        out, lse = attention_forward(q, k, v, cu_q, cu_k, q_len, kv_len, backend=backend)
        if backward:
            attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, q_len, kv_len, backend=backend)

    for _ in range(warmup):
        run()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            run()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples) / copies


def time_table(
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    backend: str = "auto",
    backward: bool = True,
    fuse_tokens: int = 65536,
    warmup: int = 3,
    repeats: int = 10,
    log=print,
) -> tuple[list[list[float | None]], str]:
    """The seconds table (None where q_len > kv_len) and the concrete backend that ran it. Runs outside
    autograd and autocast (callable from inside a model's forward)."""
    name = resolve_backend(backend, device, dtype)
    seconds: list[list[float | None]] = []
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        for q_len in q_lens:
            row: list[float | None] = []
            for kv_len in kv_lens:
                if q_len > kv_len:
                    row.append(None)
                    continue
                t = time_task(
                    q_len,
                    kv_len,
                    heads=heads,
                    kv_heads=kv_heads,
                    head_dim=head_dim,
                    dtype=dtype,
                    device=device,
                    backend=name,
                    backward=backward,
                    fuse_tokens=fuse_tokens,
                    warmup=warmup,
                    repeats=repeats,
                )
                pairs = (kv_len * (kv_len + 1) - (kv_len - q_len) * (kv_len - q_len + 1)) // 2
                flops = (4 if not backward else 14) * heads * head_dim * pairs  # fwd 4, bwd ~10 per pair
                log(
                    f"q_len {q_len:>6} kv_len {kv_len:>6}: {t * 1e3:10.4f} ms  ~{flops / t / 1e12:7.1f} TFLOP/s"
                )
                row.append(t)
            seconds.append(row)
    return seconds, name


def device_name(device: torch.device) -> str:
    """The GPU model as tables record it (``torch.cuda.get_device_name``), the CPU's name elsewhere."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or "cpu"


def provenance(
    device: torch.device,
    dtype: torch.dtype | str,
    backend: str,
    heads: int,
    kv_heads: int,
    head_dim: int,
    *,
    timed: str = "forward+backward",
    fuse_tokens: int,
    repeats: int,
) -> dict[str, Any]:
    """A table's ``measured`` object: what ran where (the fields :mod:`hf_distca.cost_tables` matches on:
    device, dtype, heads, kv_heads, head_dim, backend; plus what was timed and the software versions)."""
    measured: dict[str, Any] = {
        "device": device_name(device),
        "dtype": normalize_dtype(dtype),
        "backend": backend,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "timed": timed,
        "fuse_tokens": fuse_tokens,
        "repeats": repeats,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": _cudnn_version(),
    }
    if backend == "cudnn":
        try:
            import cudnn  # nvidia-cudnn-frontend

            measured["cudnn_frontend"] = getattr(cudnn, "__version__", None)
        except ImportError:
            pass
    measured["python"] = platform.python_version()
    measured["hf_distca"] = __version__
    return measured


def _cudnn_version() -> str | None:
    """cuDNN's version as "major.minor" (torch reports e.g. 91900 for 9.19.0); None without cuDNN."""
    v = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return None if v is None else f"{v // 10000}.{v % 10000 // 100}"
