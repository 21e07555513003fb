# Sourced at the start of every GPU command (bench/gpu/*.sh): the carried wheels (torchao for torch 2.11),
# the repository on the path, unbuffered output, and a record of the machine.
set -u
export PYTHONUNBUFFERED=1 HOPPERLM_DATA_DIR=${HOPPERLM_DATA_DIR:-$PWD/gpu-carry/data}
if ls gpu-carry/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    gpu-carry/whl/*.whl || echo "env: could not install the carried wheels"
fi
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__)"
  python3 -c "import torchao; print('torchao', torchao.__version__)" 2>/dev/null | tail -1
  git rev-parse HEAD 2>/dev/null || echo "commit: (no .git in this copy: record it by hand)"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
hl() { python3 -m hopperlm "$@"; }
speedrun() {  # NAME OVERRIDES...: Tiny Shakespeare (prepared in /tmp/shakespeare-byte) to the recipe's target;
  # wall time of the whole command, start-up and compile included
  local name=$1; shift
  local t0=$(date +%s.%N)
  timeout "${SPEEDRUN_TIMEOUT:-120}" python3 -m hopperlm train shakespeare-char-gpu --data.path /tmp/shakespeare-byte \
    --run.out_dir /tmp/run-$name "$@" > "$OUT/speedrun-$name.log" 2>&1
  local rc=$? t1=$(date +%s.%N)
  echo "speedrun $name: rc $rc, $(python3 -c "print(f'{$t1 - $t0:.1f}')") s wall | $(grep -E '^done' "$OUT/speedrun-$name.log")"
}
