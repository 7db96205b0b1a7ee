"""The sliding-window benchmarks start and print their tables (CPU smoke modes; the GPU runs measure)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*argv: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_bench_kernels_windows_smoke():
    out = _run("-m", "benchmarks.bench_kernels", "--smoke", "--windows", "64", "128")
    table = out.split("| window |")[-1]  # the final table (rows are also printed as they are measured)
    rows = [
        line.split("|") for line in table.splitlines() if line.startswith(("| causal", "| 64 ", "| 128 "))
    ]
    assert [r[1].strip() for r in rows] == ["causal", "64", "128"]
    # pairs / causal of one 512-token document: (64 x 65 / 2 + 64 x 448) / (512 x 513 / 2)
    assert [float(r[2]) for r in rows] == [1.0, round((64 * 65 / 2 + 64 * 448) / (512 * 513 / 2), 3), 0.437]


def test_bench_window_step_smoke():
    out = _run("-m", "benchmarks.bench_window_step", "--cpu", "--modes", "distca,cut-to-window")
    rows = [line for line in out.splitlines() if line.startswith(("| distca", "| cut-to-window"))]
    assert len(rows) == 2 and "error" not in out.split("| mode |")[1], out
