#!/usr/bin/env bash
# Install with the test tools, then lint and run the test suite on real data from ../shared/data.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh --dev
export HOPPERLM_DATA_DIR=${HOPPERLM_DATA_DIR:-$(cd .. && pwd)/shared/data}
"$PY" -m ruff check hopperlm tests bench
"$PY" -m ruff format --check hopperlm tests bench
# two worker processes, each file's tests in one of them (module fixtures prepare once); HOPPERLM_TEST_WORKERS=0
# runs in this process. One torch thread per process while several share the cores (the plan's own warning:
# two torch processes spinning on the same cores slow each other down): 933 s instead of 1,030 on 2 cores.
# --durations: the slowest tests, so CI time stays watched
WORKERS=${HOPPERLM_TEST_WORKERS:-2}
if [ "$WORKERS" -gt 1 ]; then export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}; fi
# --no-loadscope-reorder: xdist hands files out in conftest's order (slow files first), not by test count
"$PY" -m pytest -q -n "$WORKERS" --dist loadfile --no-loadscope-reorder --durations=15 "$@"
