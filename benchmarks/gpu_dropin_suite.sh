#!/usr/bin/env bash
# One H200: the GPU checks of the drop-in work (torch.compile, linear attention on Hopper).
#   bash benchmarks/gpu_dropin_suite.sh OUTDIR [LAYERS]
# 1. benchmarks/bench_compile.py: each decoder layer compiled (Inductor, fullgraph) vs eager, Llama-3-8B-shaped
#    with LAYERS layers (default 8), 64K tokens, rematerialization-aware checkpointing;
# 2. tests/test_gpu.py (kernel backends vs the reference, compiled layers vs eager on CUDA);
# 3. tests/test_gpu_linear.py (fla where fla-core is correct on this GPU, 'chunked' everywhere, vs float64).
# Wheels in $WHEEL_DIR (default .whl: nvidia-cudnn-frontend, fla-core, einops, pytest-timeout) are installed
# without dependencies into a temporary folder first. About 8 minutes.
set -u
out="${1:?output directory}"
layers="${2:-8}"
mkdir -p "$out"
# shellcheck source=benchmarks/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"

echo "== torch.compile of each decoder layer vs eager"
timeout 300 torchrun --nproc-per-node 1 -m benchmarks.bench_compile --layers "$layers" \
    --out "$out/compile_1xh200.md" --json "$out/compile_1xh200.json" > "$out/bench_compile.log" 2>&1
echo "rc=$?" >> "$out/bench_compile.log"; tail -8 "$out/bench_compile.log"

echo "== tests/test_gpu.py"
timeout 150 python3 -m pytest -q -rs --timeout=120 -p no:cacheprovider tests/test_gpu.py > "$out/test_gpu.log" 2>&1
echo "rc=$?" >> "$out/test_gpu.log"; tail -6 "$out/test_gpu.log"

echo "== tests/test_gpu_linear.py"
timeout 170 python3 -m pytest -q -rs --durations=5 --timeout=160 -p no:cacheprovider tests/test_gpu_linear.py \
    > "$out/test_gpu_linear.log" 2>&1
echo "rc=$?" >> "$out/test_gpu_linear.log"; tail -14 "$out/test_gpu_linear.log"
