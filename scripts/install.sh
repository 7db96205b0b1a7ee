#!/usr/bin/env bash
# Install hf_distca (editable) with the given extras into the current Python environment.
# torch: an existing install >= 2.10 is kept; otherwise TORCH_SPEC is installed (default torch==2.13.0;
# on a CPU-only machine add PIP_EXTRA_INDEX_URL pointing at PyTorch's CPU wheel index to avoid
# downloading the CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-test}"
if ! python -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 10))' 2>/dev/null; then
    python -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
fi
python -m pip install --quiet -e ".[${extras}]"
