#!/usr/bin/env bash
# Sequence-parallel linear attention on one machine with 2 GPUs (about 3 minutes):
#   bash benchmarks/gpu_linear_suite.sh OUTDIR
# Needs flash-linear-attention importable (pip install fla-core, or its wheel on PYTHONPATH); without it the
# local part falls back to the per-token reference and the layer/model timings mean little.
# Writes: gpus.txt, linear_sp.md, linear_sp.json, bench_linear_sp.log in OUTDIR.
set -u
out="${1:?output directory}"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python -c "import sys, torch, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__)"
  python -c "import fla, triton; print('fla', getattr(fla, '__version__', '?'), 'triton', triton.__version__)" || echo "fla not importable"
} > "$out/gpus.txt" 2>&1
cat "$out/gpus.txt"
timeout 420 torchrun --nproc-per-node 2 benchmarks/bench_linear_sp.py --out "$out" > "$out/bench_linear_sp.log" 2>&1
echo "rc=$?" >> "$out/bench_linear_sp.log"
tail -5 "$out/bench_linear_sp.log"
