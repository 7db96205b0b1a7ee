#!/usr/bin/env bash
# Kernel checks and benchmark on one GPU: the GPU kernel tests (torch_varlen, cudnn, reference), then the
# kernel table (FA2 varlen vs cuDNN, both suffix strategies, peak memory, plan-build and rounding costs).
#   bash benchmarks/gpu_kernels_suite.sh OUTDIR [DOCLENS.json ...]
# The cudnn backend needs NVIDIA's cudnn-frontend; if a wheel nvidia_cudnn_frontend-*.whl lies in
# $WHEEL_DIR (default .whl), it is installed into /tmp/site without its declared dependencies (it runs
# on torch's own libcudnn). DOCLENS files (JSON lists of document lengths) add server task-mix rows.
# Writes to OUTDIR: env.txt, pytest_gpu.log, bench_kernels.log, kernels.md.
set -u
out="${1:?output directory}"
shift
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
wheel_dir="${WHEEL_DIR:-.whl}"
site=""
if ls "$wheel_dir"/nvidia_cudnn_frontend-*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$wheel_dir"/nvidia_cudnn_frontend-*.whl && site=/tmp/site
fi
export PYTHONPATH="$PWD${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
  python3 -c "import cudnn; print('cudnn-frontend', getattr(cudnn, '__version__', '?'), 'backend', cudnn.backend_version())" 2>&1 | tail -1
  python3 -c "import torch; from hf_distca.kernels import available_backends as a; print('backends', a(torch.device('cuda'), torch.bfloat16))"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
echo "== GPU kernel tests"
timeout 110 python3 -m pytest -q -rs tests/test_gpu.py -p no:cacheprovider > "$out/pytest_gpu.log" 2>&1
echo "rc=$?" >> "$out/pytest_gpu.log"; tail -25 "$out/pytest_gpu.log"
echo "== kernel benchmark"
doclens=()
if [ $# -gt 0 ]; then doclens=(--doclens "$@"); fi
timeout 150 python3 -m benchmarks.bench_kernels --out "$out/kernels.md" "${doclens[@]}" > "$out/bench_kernels.log" 2>&1
echo "rc=$?" >> "$out/bench_kernels.log"; grep -v '^|' "$out/bench_kernels.log" | tail -30
cat "$out/kernels.md" 2>/dev/null
