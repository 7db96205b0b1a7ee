#!/usr/bin/env bash
# Write constraints/tested.txt from the current environment: run it in the virtualenv of a green
# `HF_DISTCA_DEPS=latest bash scripts/run_tests.sh` (with every test extra installed), then commit the file.
# torch and triton stay out (see the file's header).
set -euo pipefail
cd "$(dirname "$0")/.."
torch_version="$(python -c 'import torch; print(torch.__version__)')"
{
    echo "# The versions the whole test suite and the demo passed with on $(date +%Y-%m-%d) (Python $(python -c 'import platform; print(platform.python_version())'), torch $torch_version,"
    echo "# fresh virtualenv, bash .ci/run). scripts/install.sh installs under these constraints unless"
    echo "# HF_DISTCA_DEPS=latest; regenerate with scripts/pin_versions.sh after a green run on the newest releases."
    echo "# torch and triton are not pinned here: scripts/install.sh keeps the torch a machine has (>= 2.10) or"
    echo "# installs TORCH_SPEC (default torch==2.13.0), which brings its own triton."
    python -m pip freeze --exclude-editable | grep -v -i -E '^(hf[-_]distca|torch|triton)==' | sort -f
} > constraints/tested.txt.new
mv constraints/tested.txt.new constraints/tested.txt
echo "wrote constraints/tested.txt ($(grep -vc '^#' constraints/tested.txt) packages)"
