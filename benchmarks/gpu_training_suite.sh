#!/usr/bin/env bash
# The recipe on 2 GPUs: (1) DDP, FSDP2 and DeepSpeed ZeRO-3 on a Llama-3-8B-shaped model (2 layers),
# first-step losses side by side, and benchmarks/zero3_first_step.py (initial-weight checksums and
# first-step losses of the random-init model built for DDP, inside deepspeed.zero.Init, and whole);
# (2) step time of DistCA vs the same data path without disaggregation (--attn local: same kernels,
# each rank attends within its own pieces) on long-tailed documents.
#   bash benchmarks/gpu_training_suite.sh OUTDIR
# Needs deepspeed importable for the ZeRO-3 runs.
set -u
out="${1:?output directory}"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
runs=/tmp/hf_distca_runs
rm -rf "$runs"; mkdir -p "$runs"
recipe=recipes/finetune_long_docs.py
par="--model llama3-8b-shaped --num-layers 2 --tokens-per-rank 16384 --max-steps 1 --bf16 --no-save --seed 1 \
     --num-documents 200 --mean-doc-words 2000 --max-doc-words 30000 --learning-rate 1e-5"
log="$out/training.log"
: > "$log"
step() { echo "== $1" | tee -a "$log"; shift; timeout "${STEP_TIMEOUT:-300}" "$@" >> "$log" 2>&1; echo "rc=$?" | tee -a "$log"; }
step "DDP" torchrun --nproc-per-node 2 $recipe $par --output-dir $runs/ddp
step "FSDP2" accelerate launch --config_file accelerate_configs/fsdp2_1node.yaml $recipe $par --output-dir $runs/fsdp2
step "ZeRO-3" torchrun --nproc-per-node 2 $recipe $par --deepspeed accelerate_configs/ds_zero3.json --output-dir $runs/zero3
step "ZeRO-3 first step" torchrun --nproc-per-node 2 -m benchmarks.zero3_first_step --out "$out"
python -m benchmarks.compare_runs ddp=$runs/ddp fsdp2=$runs/fsdp2 zero3=$runs/zero3 --skip 0 \
    --title "DDP / FSDP2 / ZeRO-3, Llama-3-8B-shaped (2 layers), 2 x 16K tokens, bf16" > "$out/parallelisms.md" 2>>"$log"
cat "$out/parallelisms.md"
speed="--model llama3-8b-shaped --num-layers 4 --tokens-per-rank 32768 --max-steps 7 --bf16 --no-save --seed 2 \
       --gradient-checkpointing --num-documents 400 --mean-doc-words 2500 --max-doc-words 45000 --learning-rate 1e-5"
step "DistCA" torchrun --nproc-per-node 2 $recipe $speed --attn distca --output-dir $runs/distca
step "local" torchrun --nproc-per-node 2 $recipe $speed --attn local --output-dir $runs/local
python -m benchmarks.compare_runs local=$runs/local distca=$runs/distca --skip 2 --baseline local \
    --title "Step time, DDP on 2 GPUs, Llama-3-8B-shaped (4 layers), 2 x 32K tokens, bf16, gradient checkpointing" \
    > "$out/step_time.md" 2>>"$log"
cat "$out/step_time.md"
cp $runs/distca/metrics.jsonl "$out/distca_metrics.jsonl" 2>/dev/null
