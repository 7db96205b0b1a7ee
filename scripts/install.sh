#!/usr/bin/env bash
# Install hf_distca (editable) with the given extras into the current Python environment.
# Versions: HF_DISTCA_DEPS=tested (the default) installs under constraints/tested.txt, the set the whole
# suite last passed with, so a fresh machine runs what passed then; HF_DISTCA_DEPS=latest upgrades every
# dependency to its newest release within setup.cfg's ranges (run the tests that way before pinning anew
# with scripts/pin_versions.sh).
# torch: an existing install >= 2.10 is kept; otherwise TORCH_SPEC is installed (default torch==2.13.0;
# on a CPU-only machine add PIP_EXTRA_INDEX_URL pointing at PyTorch's CPU wheel index to avoid
# downloading the CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-test}"
deps="${HF_DISTCA_DEPS:-tested}"
case "$deps" in
    tested) versions=(-c constraints/tested.txt) ;;
    latest) versions=(--upgrade --upgrade-strategy eager) ;;
    *) echo "HF_DISTCA_DEPS=$deps: use 'tested' (constraints/tested.txt) or 'latest' (newest releases)" >&2
       exit 2 ;;
esac
if ! python -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 10))' 2>/dev/null; then
    python -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
fi
python -m pip install --quiet "${versions[@]}" -e ".[${extras}]"
python - <<'PY'
import importlib.metadata as md
import os

names = ("torch", "transformers", "accelerate", "kernels", "deepspeed", "trl", "datasets")
found = []
for name in names:
    try:
        found.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        pass
print(f"hf_distca dependencies ({os.environ.get('HF_DISTCA_DEPS', 'tested')}): " + ", ".join(found))
PY
