#!/usr/bin/env bash
# Install hf_distca with its test dependencies, then lint and run the test suite.
# pytest's "no tests collected" (exit 5) counts as a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test || exit 1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python -m ruff check . || exit 1
python -m ruff format --check . || exit 1
python -m pytest -q -p no:cacheprovider --timeout=900 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit "$rc"
