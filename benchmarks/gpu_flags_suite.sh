#!/usr/bin/env bash
# The recipe's distca run against its same-kernels baseline as the README presents it (--attn local with
# the torch_varlen kernel and plain recompute: what FA2-style varlen training does), on the same documents,
# beside the engine-level figures of bench_remat on the same length sample.
#   bash benchmarks/gpu_flags_suite.sh OUTDIR LENGTHS_JSON [LAYERS] [TOKENS]
# Llama-3-8B-shaped (LAYERS layers, default 8), bf16, TOKENS tokens per rank (default 65536), one GPU.
# Writes in OUTDIR: gpus.txt, recipe_{distca,local}/ (metrics.jsonl, summary.json), recipe_*.log,
# remat.md/.json and remat.log. About 4 minutes on one H200.
set -u
out="${1:?output directory}"
lengths="${2:?path of a document-length sample (JSON list)}"
layers="${3:-8}"
tokens="${4:-65536}"
mkdir -p "$out"
# shellcheck source=benchmarks/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
export TOKENIZERS_PARALLELISM=false
common=(--model llama3-8b-shaped --num-layers "$layers" --bf16 --gradient-checkpointing --tokens-per-rank "$tokens"
        --max-steps 6 --doc-lengths "$lengths" --num-documents 600 --no-save)
declare -A flags=([distca]="" [local]="--attn local --backend torch_varlen --recompute-attention")
for run in distca local; do
    echo "== recipe: $run"
    # shellcheck disable=SC2086
    timeout 300 python recipes/finetune_long_docs.py "${common[@]}" ${flags[$run]} \
        --output-dir "$out/recipe_$run" > "$out/recipe_$run.log" 2>&1
    echo "rc=$?" >> "$out/recipe_$run.log"; tail -3 "$out/recipe_$run.log"
done
echo "== engine level: bench_remat, remat+cudnn vs recompute+torch_varlen"
timeout 300 torchrun --nproc-per-node 1 -m benchmarks.bench_remat --layers "$layers" --tokens-per-rank "$tokens" \
    --doc-lengths "sample=$lengths" --backends cudnn,torch_varlen --skip-none-for sample \
    --out "$out/remat.md" --json "$out/remat.json" > "$out/remat.log" 2>&1
echo "rc=$?" >> "$out/remat.log"; tail -12 "$out/remat.log"
