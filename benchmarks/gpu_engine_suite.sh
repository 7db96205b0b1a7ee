#!/usr/bin/env bash
# GPU checks and benchmarks of the engine and kernels on one machine with 2 GPUs.
#   bash benchmarks/gpu_engine_suite.sh OUTDIR
# Writes: gpus.txt, nccl_engine_check.log, engine_2gpu.md, kernels.md (+ their logs) in OUTDIR.
set -u
out="${1:?output directory}"
mkdir -p "$out"
# shellcheck source=benchmarks/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
echo "== NCCL equality check (bf16 vs float64 oracle)"
timeout 300 torchrun --nproc-per-node 2 tests/gpu_nccl_engine_check.py > "$out/nccl_engine_check.log" 2>&1
echo "rc=$?" >> "$out/nccl_engine_check.log"; tail -3 "$out/nccl_engine_check.log"
echo "== engine benchmark (skewed layout)"
timeout 240 torchrun --nproc-per-node 2 -m benchmarks.bench_engine --out "$out/engine_2gpu.md" > "$out/bench_engine.log" 2>&1
echo "rc=$?" >> "$out/bench_engine.log"; tail -25 "$out/bench_engine.log"
echo "== kernel benchmark"
timeout 200 python -m benchmarks.bench_kernels --out "$out/kernels.md" > "$out/bench_kernels.log" 2>&1
echo "rc=$?" >> "$out/bench_kernels.log"; tail -15 "$out/bench_kernels.log"
