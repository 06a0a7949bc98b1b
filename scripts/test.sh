#!/usr/bin/env bash
# Run the test suite (CPU; CUDA tests skip without a GPU). Extra arguments go to pytest.
#   scripts/test.sh            the suite, less the tests marked long
#   scripts/test.sh --long     the tests marked long: the benchmark scripts' smoke tests and
#                              whole sweeps with faults, each a minute or more end to end (CI
#                              runs them as its second job, after the suite)
# The exit code is pytest's; a skipped browser check of the HTML report is said in one line
# after pytest's output (under CI=true that test fails instead of skipping).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$ROOT"
marker="not long"
if [ "${1:-}" = "--long" ]; then
    marker="long"
    shift
fi
results="$(mktemp -d)"
trap 'rm -rf "$results"' EXIT
status=0
# Most tests wait on Ray, subprocesses and sockets rather than compute: three workers, one test
# file each at a time (a file's fixtures are set up once), beat one on two cores. The slowest
# tests are listed at the end: where the suite's time goes. The files with slow tests start first
# (tests/conftest.py orders them), so that no minutes-long file is left to run alone at the end.
# A -m of the caller's comes after ours and wins.
python -m pytest -q -n "${TRACEFLEET_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder \
    --durations=15 --junitxml="$results/junit.xml" -m "$marker" "$@" || status=$?
if grep -q "<skipped[^>]*chromium-headless-shell is not installed" "$results/junit.xml" 2>/dev/null; then
    echo "[test.sh] SKIPPED the HTML report's browser check: no chromium-headless-shell" \
         "(apt-get install chromium-headless-shell)"
fi
exit "$status"
