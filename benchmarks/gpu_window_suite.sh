#!/usr/bin/env bash
# One H200: sliding windows on the GPU, the linear-attention GPU tests, and the kernel cost tables.
#   bash benchmarks/gpu_window_suite.sh OUTDIR
# 1. tests/test_gpu.py -k "sliding_window or compiled": every CUDA backend's window against the reference;
# 2. benchmarks/bench_kernels.py --windows: one 64K document, windowed vs full causal TFLOP/s;
# 3. benchmarks/bench_window_step.py: Gemma-3-4B-shaped step (6 layers, 5 local : 1 global) at 64K tokens,
#    distca vs every document cut to the window vs sdpa;
# 4. tests/test_gpu_linear.py (chunked and the Qwen3-Next layer first, then fla's kernels);
# 5. python -m hf_distca.calibrate: the (q_len, kv_len) -> seconds tables of the cudnn and torch_varlen
#    backends for bf16 32/8 heads x 128.
# Wheels in $WHEEL_DIR (default .whl) are installed without dependencies first. About 9 minutes.
set -u
out="${1:?output directory}"
mkdir -p "$out"
# shellcheck source=benchmarks/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
run() {  # name timeout command...
    local name=$1 limit=$2
    shift 2
    echo "== $name"
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "rc=$?" >> "$out/$name.log"
    tail -14 "$out/$name.log"
}
run test_gpu_window 100 python3 -m pytest -q -rs --timeout=90 -p no:cacheprovider tests/test_gpu.py \
    -k "sliding_window or compiled"
run kernels_window 110 python3 -m benchmarks.bench_kernels --windows 1024 2048 4096 8192 --tokens 65536 \
    --out "$out/kernels_window_h200.md"
run window_step 200 torchrun --nproc-per-node 1 -m benchmarks.bench_window_step --layers 6 \
    --tokens-per-rank 65536 --out "$out/window_step_h200.md"
run test_gpu_linear 90 python3 -m pytest -q -rs --durations=8 --timeout=80 -p no:cacheprovider \
    tests/test_gpu_linear.py
for backend in cudnn torch_varlen; do
    run "calibrate_$backend" 45 python3 -m hf_distca.calibrate --backend "$backend" \
        --out "$out/h200_bf16_32x8x128_$backend.json"
done
