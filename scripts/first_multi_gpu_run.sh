#!/usr/bin/env bash
# The first multi-GPU run as one command: the engine's NCCL check, the recipe under DDP, FSDP2 and ZeRO-3
# in every schedule, one step under TORCH_DISTRIBUTED_DEBUG=DETAIL; one results file (<out>/results.md).
#   bash scripts/first_multi_gpu_run.sh 8           # 8 GPUs of one node
#   bash scripts/first_multi_gpu_run.sh 2 --cpu     # 2 CPU processes over gloo (the default without a GPU)
# Options: python scripts/first_multi_gpu_run.py --help
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" scripts/first_multi_gpu_run.py "$@"
