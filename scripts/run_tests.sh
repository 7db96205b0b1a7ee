#!/usr/bin/env bash
# Install hf_distca with its test dependencies, then lint and run the test suite.
# pytest's "no tests collected" (exit 5) counts as a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test || exit 1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python -m ruff check . || exit 1
python -m ruff format --check . || exit 1
# two workers (pytest-xdist; PYTEST_WORKERS overrides): most tests run one process on one core, so a second
# worker fills the other core; work stealing keeps the multi-process runs from queueing behind each other.
# The timing tests (tests/test_timing.py) then run alone: a busy second core inflates even CPU time.
# Extra arguments go to pytest; when they name tests, only those run, in one parallel run.
workers="${PYTEST_WORKERS:-$(( $(nproc) < 2 ? 1 : 2 ))}"
timing=tests/test_timing.py
pytest_cmd=(python -m pytest -q -p no:cacheprovider)
named_tests=0
for arg in "$@"; do
    case "$arg" in tests*|*.py|*::*) named_tests=1 ;; esac
done
if [ "$named_tests" -eq 1 ]; then
    "${pytest_cmd[@]}" --timeout=900 -n "$workers" --dist worksteal "$@"
    rc=$?
    rc_timing=5
else
    "${pytest_cmd[@]}" --timeout=900 -n "$workers" --dist worksteal --ignore="$timing" "$@"
    rc=$?
    "${pytest_cmd[@]}" --timeout=300 "$@" "$timing"
    rc_timing=$?
fi
# no test collected fails; with filters given, one of the two runs may be empty
if { [ "$rc" -eq 5 ] && [ "$rc_timing" -eq 5 ]; } || { [ $# -eq 0 ] && { [ "$rc" -eq 5 ] || [ "$rc_timing" -eq 5 ]; }; }; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
for code in "$rc" "$rc_timing"; do
    if [ "$code" -ne 0 ] && [ "$code" -ne 5 ]; then
        exit "$code"
    fi
done
exit 0
