#!/usr/bin/env bash
# Sequence-parallel linear attention on one machine with 2 GPUs (about 10 minutes: the first use of each of
# flash-linear-attention's four kernel families compiles Triton kernels for a minute or more):
#   bash benchmarks/gpu_linear_suite.sh OUTDIR
# Needs flash-linear-attention importable (pip install fla-core, or its wheel on PYTHONPATH); without it, or
# where fla-core would get a transition wrong (gated kernels on Hopper with Triton >= 3.4.0 and < 3.7.1),
# 'auto' runs the chunked PyTorch backend instead, and the timings are of that.
# Writes: gpus.txt, pytest_gpu_linear.log, linear_sp.md, linear_sp.json, bench_linear_sp.log in OUTDIR.
set -u
out="${1:?output directory}"
mkdir -p "$out"
# shellcheck source=benchmarks/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
echo "== chunked and fla kernels vs the float64 reference (tests/test_gpu_linear.py)"
timeout 400 python -m pytest -q -rs -p no:cacheprovider tests/test_gpu_linear.py > "$out/pytest_gpu_linear.log" 2>&1
echo "rc=$?" >> "$out/pytest_gpu_linear.log"; tail -3 "$out/pytest_gpu_linear.log"
timeout 420 torchrun --nproc-per-node 2 -m benchmarks.bench_linear_sp --out "$out" > "$out/bench_linear_sp.log" 2>&1
echo "rc=$?" >> "$out/bench_linear_sp.log"
tail -5 "$out/bench_linear_sp.log"
