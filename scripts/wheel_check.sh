#!/usr/bin/env bash
# A regular install, as a user makes it: build the wheel, install it into a fresh virtual environment with the
# CPU build of torch, and run hopperlm from a folder outside the repository (named recipes, a few-second demo).
# CI runs this after the test suite; it needs only the package index, like scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
# the venv (torch: ~15k files) is deleted in the background: deleting it took 88 s of CI's time before the tests
trap 'nohup rm -rf "$WORK" >/dev/null 2>&1 &' EXIT

quiet() {  # run a pip step; show its output only when it fails
  "$@" >"$WORK/step.log" 2>&1 || { cat "$WORK/step.log"; echo "wheel-check: failed: $*"; exit 1; }
}
mkdir "$WORK/src"  # build from a copy of the tracked files: nothing is written into the checkout
git ls-files -z | tar --null -cf - -T - | tar -xf - -C "$WORK/src"
# build isolation: pip brings the build backend pyproject.toml names (setuptools >= 70.1 builds wheels by
# itself), so a fresh Python whose setuptools has no bdist_wheel (no `wheel` package) builds it too
quiet "$PY" -m pip wheel --no-deps -w "$WORK/dist" "$WORK/src"
wheel=$(ls "$WORK"/dist/hopperlm-*.whl)
"$PY" -c "import sys, zipfile; sys.exit('hopperlm/recipes/debug.yaml' not in zipfile.ZipFile(sys.argv[1]).namelist())" \
  "$wheel" || { echo "wheel-check: the wheel has no recipes (hopperlm/recipes/*.yaml)"; exit 1; }

"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
# --no-compile: no bytecode for the ~20k files installed (pip compiles them one by one, most of this venv's
# install time beside setup's): each of the three commands below compiles what it imports, a few seconds
quiet "$VPY" -m pip install --no-compile "torch==2.13.0" "$wheel"

mkdir -p "$WORK/elsewhere" && cd "$WORK/elsewhere"
export HOPPERLM_DATA_DIR=${HOPPERLM_DATA_DIR:-$(cd "$REPO/.." && pwd)/shared/data}
"$WORK/venv/bin/hopperlm" presets >/dev/null
"$WORK/venv/bin/hopperlm" diagnose owt-350m-h100 --simulate "H100 80GB" >/dev/null
"$WORK/venv/bin/hopperlm" demo --out runs/demo --samples 1 --train.max_hours null --train.max_steps 20 \
  --log.report false --log.tensorboard false | tail -n 1
test -f runs/demo/metrics.jsonl
echo "wheel-check: $(basename "$wheel") installed in a fresh venv; presets, diagnose and demo ran outside the repository"
