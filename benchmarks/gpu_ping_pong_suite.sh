#!/usr/bin/env bash
# Ping-pong on 2 GPUs (issue 9): is core attention's communication hidden, on NVLink and on a slow link?
#   bash benchmarks/gpu_ping_pong_suite.sh OUTDIR PROLONG_LENGTHS_JSON [LAYERS] [PHASE]
# PHASE (default all; run phases as separate commands when one command may not run ~25 minutes):
#   check     ~2 min  tests/gpu_nccl_engine_check.py: the engine over NCCL in bf16 vs the float64 oracle;
#                     ping-pong is on by default on CUDA, so this checks its stream ordering
#   nvlink    ~8 min  benchmarks/bench_ping_pong.py: Llama-3-8B-shaped (LAYERS layers, default 8), bf16, DDP,
#                     rematerialization-aware checkpointing, 32K and 64K tokens per rank, the long-document mix
#                     and the ProLong sample: step time with ping-pong, without overlap (serial), with
#                     signal-only exchanges (1-byte messages: free communication), signal-only with
#                     ping-pong, and the exact unbalanced baseline (max_planner_moves=0); one profiled
#                     step of ping-pong and serial each, summarised per layer (traces in OUTDIR/traces)
#   p2p       ~9 min  the same with NCCL_P2P_DISABLE=1 (all-to-all through host memory, ~23 GiB/s)
#   group     ~2 min  64K mix, ping-pong and serial with the attention exchanges on the world group
#                     (the one DDP's all-reduce uses) instead of a dedicated one
#   parallel  ~4 min  the recipe under DDP, FSDP2 and ZeRO-3 (2 layers, 2 x 16K, 2 steps) with --ping-pong and
#                     --no-ping-pong: the same losses (ZeRO-3 only when deepspeed imports)
# Writes in OUTDIR: gpus.txt, nccl_engine_check.log, ping_pong_{nvlink,p2p}.md/.json (+ .log),
# ping_pong_group.md, parallelisms_ping_pong.md, traces/*.json.gz.
set -u
out="${1:?output directory}"
prolong="${2:?path of the ProLong document-length sample (JSON list)}"
layers="${3:-8}"
phase="${4:-all}"
mkdir -p "$out/traces"
# shellcheck source=benchmarks/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
export TOKENIZERS_PARALLELISM=false
bench=(-m benchmarks.bench_ping_pong --layers "$layers" --tokens-per-rank 32768,65536 --doc-lengths mix
       --doc-lengths "prolong=$prolong" --trace-dir "$out/traces")
want() { [ "$phase" = all ] || [ "$phase" = "$1" ]; }

if want check; then
  echo "== NCCL equality check with ping-pong (bf16 vs float64 oracle)"
  timeout 300 torchrun --nproc-per-node 2 tests/gpu_nccl_engine_check.py > "$out/nccl_engine_check.log" 2>&1
  echo "rc=$?" >> "$out/nccl_engine_check.log"; tail -3 "$out/nccl_engine_check.log"
fi
if want nvlink; then
  echo "== NVLink"
  timeout 900 torchrun --nproc-per-node 2 "${bench[@]}" --link nvlink \
      --out "$out/ping_pong_nvlink.md" --json "$out/ping_pong_nvlink.json" > "$out/ping_pong_nvlink.log" 2>&1
  echo "rc=$?" >> "$out/ping_pong_nvlink.log"; tail -14 "$out/ping_pong_nvlink.log"
fi
if want p2p; then
  echo "== NCCL_P2P_DISABLE=1"
  NCCL_P2P_DISABLE=1 timeout 900 torchrun --nproc-per-node 2 "${bench[@]}" --link p2p-disabled \
      --out "$out/ping_pong_p2p.md" --json "$out/ping_pong_p2p.json" > "$out/ping_pong_p2p.log" 2>&1
  echo "rc=$?" >> "$out/ping_pong_p2p.log"; tail -14 "$out/ping_pong_p2p.log"
fi
if want group; then
  echo "== attention exchanges on the world group (shared with DDP's all-reduce)"
  timeout 300 torchrun --nproc-per-node 2 -m benchmarks.bench_ping_pong --layers "$layers" --tokens-per-rank 65536 \
      --doc-lengths mix --modes ping_pong,serial --profile ping_pong --attn-group world --link nvlink \
      --trace-dir "$out/traces/world_group" --out "$out/ping_pong_group.md" > "$out/ping_pong_group.log" 2>&1
  echo "rc=$?" >> "$out/ping_pong_group.log"; tail -6 "$out/ping_pong_group.log"
fi
if want parallel; then
  runs=/tmp/hf_distca_ping_pong_runs
  rm -rf "$runs"; mkdir -p "$runs"
  log="$out/parallelisms_ping_pong.log"; : > "$log"
  recipe=recipes/finetune_long_docs.py
  par="--model llama3-8b-shaped --num-layers 2 --tokens-per-rank 16384 --max-steps 2 --bf16 --no-save --seed 1 \
       --num-documents 200 --mean-doc-words 2000 --max-doc-words 30000 --learning-rate 1e-5 --gradient-checkpointing"
  step() { echo "== $1" | tee -a "$log"; shift; timeout 300 "$@" >> "$log" 2>&1; echo "rc=$?" | tee -a "$log"; }
  labels=()
  for pp in ping-pong no-ping-pong; do
    step "DDP --$pp" torchrun --nproc-per-node 2 $recipe $par --$pp --output-dir $runs/ddp-$pp
    step "FSDP2 --$pp" accelerate launch --config_file accelerate_configs/fsdp2_1node.yaml $recipe $par --$pp \
        --output-dir $runs/fsdp2-$pp
    labels+=("ddp-$pp=$runs/ddp-$pp" "fsdp2-$pp=$runs/fsdp2-$pp")
    if python -c "import deepspeed" 2>/dev/null; then
      step "ZeRO-3 --$pp" torchrun --nproc-per-node 2 $recipe $par --$pp --deepspeed accelerate_configs/ds_zero3.json \
          --output-dir $runs/zero3-$pp
      labels+=("zero3-$pp=$runs/zero3-$pp")
    fi
  done
  python -m benchmarks.compare_runs "${labels[@]}" --skip 1 --baseline ddp-no-ping-pong \
      --title "Ping-pong under DDP / FSDP2 / ZeRO-3, Llama-3-8B-shaped (2 layers), 2 x 16K tokens, bf16" \
      > "$out/parallelisms_ping_pong.md" 2>>"$log"
  cat "$out/parallelisms_ping_pong.md"
fi
