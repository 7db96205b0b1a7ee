#!/usr/bin/env bash
# One GPU's memory: the offload's GPU tests, then the memory ladder (benchmarks/memory_ladder.py) of the
# Llama-3-8B-shaped model with LAYERS layers (default 32), bf16, SGD, rematerialization-aware checkpointing.
#   bash benchmarks/gpu_memory_suite.sh OUTDIR [LAYERS] [LADDER] [LENGTHS_JSON]
# LADDER: the ladder's sets and tokens per step, space-separated SET=T1,T2 (default: everything on at 262144
# and 524288 tokens, then today's configuration at 131072); LENGTHS_JSON: a document-length sample (default:
# the ladder's packed mix of 1K-32K documents). Writes in OUTDIR: gpus.txt, tests_*.log, ladder.md/.json
# (rewritten after every run), runs/<set>_<tokens>/ (log.txt, summary.json, metrics.jsonl), ladder.log.
# Bounded to about 8 minutes ($BUDGET seconds, default 470): the ladder gets what the tests left.
set -u
out="${1:?output directory}"
layers="${2:-32}"
ladder="${3:-+norms=262144,524288 remat=131072}"
lengths="${4:-}"
mkdir -p "$out"
# shellcheck source=benchmarks/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
export TOKENIZERS_PARALLELISM=false PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
{ free -g; cat /sys/fs/cgroup/memory.max 2>/dev/null; } >> "$out/gpus.txt"
for t in ${TESTS:-test_gpu_offload test_offload}; do  # TESTS: the test files to run first
    echo "== tests/$t.py"
    timeout 150 python -m pytest -x -q --timeout 120 "tests/$t.py" > "$out/tests_$t.log" 2>&1
    echo "rc=$?" >> "$out/tests_$t.log"; tail -3 "$out/tests_$t.log"
done
left=$(( ${BUDGET:-470} - SECONDS ))
(( left < 1 )) && left=1  # the tests overran: the ladder starts nothing (timeout 0 would mean no limit)
echo "== memory ladder ($left s left)"
sets=()
for spec in $ladder; do sets+=(--ladder "$spec"); done
timeout $(( left + 30 )) python -m benchmarks.memory_ladder --out "$out" --num-layers "$layers" "${sets[@]}" \
    --max-steps 2 --timeout 300 --deadline "$left" ${lengths:+--doc-lengths "$lengths"} > "$out/ladder.log" 2>&1
echo "rc=$?" >> "$out/ladder.log"
cat "$out/ladder.md"
