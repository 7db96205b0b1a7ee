#!/usr/bin/env bash
# Install hf_distca and run the main job: a short real training run of a tiny Llama on generated long
# documents, 2 CPU processes over gloo, DistCA balancing core attention between them.
# Extra arguments go to the recipe (e.g. --max-steps 50 --tokens-per-rank 4096).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh recipes
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python -m accelerate.commands.launch --config_file accelerate_configs/cpu_2proc.yaml \
    recipes/finetune_long_docs.py --output-dir "${OUTPUT_DIR:-outputs/demo}" "$@"
