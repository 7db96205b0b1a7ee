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
# Extra arguments go to pytest: options to both runs; test paths to the run they belong to.
# (nproc honours OMP_NUM_THREADS, set to 1 above: count the cores without it)
cores="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"
workers="${PYTEST_WORKERS:-$(( cores < 2 ? 1 : 2 ))}"
timing=tests/test_timing.py
options=() paths=() timing_paths=() takes_value=0
for arg in "$@"; do
    if [ "$takes_value" -eq 1 ]; then
        options+=("$arg")
        takes_value=0
        continue
    fi
    case "$arg" in
        -k|-m|-p|-c|-o|-n|-W|--deselect|--ignore|--ignore-glob|--junitxml|--rootdir|--basetemp|--durations|--timeout|--dist|--maxfail)
            options+=("$arg")
            takes_value=1 ;;
        -*) options+=("$arg") ;;
        *test_timing.py*) timing_paths+=("$arg") ;;
        *) paths+=("$arg") ;;
    esac
done
pytest_cmd=(python -m pytest -q -p no:cacheprovider "${options[@]}")
rc=5
if [ "${#paths[@]}" -gt 0 ] || [ "${#timing_paths[@]}" -eq 0 ]; then
    "${pytest_cmd[@]}" --timeout=900 -n "$workers" --dist worksteal --ignore="$timing" "${paths[@]}"
    rc=$?
fi
rc_timing=5
if [ "${#timing_paths[@]}" -gt 0 ]; then
    "${pytest_cmd[@]}" --timeout=300 "${timing_paths[@]}"
    rc_timing=$?
elif [ "${#paths[@]}" -eq 0 ]; then
    "${pytest_cmd[@]}" --timeout=300 "$timing"
    rc_timing=$?
fi
# no test collected fails; with arguments, one of the two runs may be empty (or not run)
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
