#!/usr/bin/env bash
# Rematerialization-aware checkpointing on the GPU (issue 8) and the cost of the cross-rank input check.
#   bash benchmarks/gpu_remat_suite.sh OUTDIR PROLONG_LENGTHS_JSON [LAYERS]
# Llama-3-8B-shaped (LAYERS layers, default 8), bf16, 64K tokens per rank, on 1 GPU and on 2 GPUs:
# step time and peak memory with no checkpointing (where it fits), plain recompute
# (--recompute-attention) and rematerialization-aware checkpointing, for a generated long-document mix
# and the ProLong length sample; then the consistency check's cost per micro-batch over NCCL.
# Writes in OUTDIR: gpus.txt, remat_1gpu.md/.json, remat_2gpu.md/.json, consistency_2gpu.md and logs.
# About 6-7 minutes on 2 x H200.
set -u
out="${1:?output directory}"
prolong="${2:?path of the ProLong document-length sample (JSON list)}"
layers="${3:-8}"
mkdir -p "$out"
# shellcheck source=benchmarks/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
export TOKENIZERS_PARALLELISM=false
samples=(--doc-lengths mix --doc-lengths "prolong=$prolong")

echo "== 1 GPU: none / recompute / remat"
timeout 300 torchrun --nproc-per-node 1 -m benchmarks.bench_remat --layers "$layers" "${samples[@]}" \
    --out "$out/remat_1gpu.md" --json "$out/remat_1gpu.json" > "$out/remat_1gpu.log" 2>&1
echo "rc=$?" >> "$out/remat_1gpu.log"; tail -16 "$out/remat_1gpu.log"

# no checkpointing on 2 GPUs only where it fitted on 1 GPU with room to spare (an out-of-memory rank
# would leave the other one waiting in a collective)
skip=$(python - "$out/remat_1gpu.json" <<'EOF'
import json, sys
try:
    results = json.load(open(sys.argv[1]))
except OSError:
    results = {}
names = [n for n, r in results.items() if r["modes"].get("none", {}).get("peak_gib", 1e9) > 120]
print(",".join(names) if results else "mix,prolong")
EOF
)
echo "== 2 GPUs: none / recompute / remat (no 'none' for: ${skip:-nothing})"
timeout 300 torchrun --nproc-per-node 2 -m benchmarks.bench_remat --layers "$layers" "${samples[@]}" \
    --skip-none-for "$skip" --out "$out/remat_2gpu.md" --json "$out/remat_2gpu.json" > "$out/remat_2gpu.log" 2>&1
echo "rc=$?" >> "$out/remat_2gpu.log"; tail -16 "$out/remat_2gpu.log"

echo "== consistency check cost (2 GPUs, NCCL)"
timeout 120 torchrun --nproc-per-node 2 -m benchmarks.bench_consistency --doc-lengths "$prolong" \
    --out "$out/consistency_2gpu.md" > "$out/consistency_2gpu.log" 2>&1
echo "rc=$?" >> "$out/consistency_2gpu.log"; tail -12 "$out/consistency_2gpu.log"
