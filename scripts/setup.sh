#!/usr/bin/env bash
# Install hopperlm (editable) and what it needs into the current Python, with the extras the docs' commands use
# on any machine: gguf (`export --format gguf`), eval (`eval --tasks`) and hf (transformers: an export loaded with
# AutoModelForCausalLM.from_pretrained). `--dev` adds the test tools (the dev extra holds those three too).
# torch is installed first and on purpose: without a GPU on Linux we take the CPU build (torch==2.13.0+cpu) from
# PyTorch's CPU wheel index, so pip never pulls the multi-GB CUDA build (the package index's default for Linux)
# onto a machine that cannot use it; where that index cannot be reached (offline, behind a mirror) the package
# index's default is taken, and the script says which. An installed torch >= 2.11 is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras="gguf,eval,hf" mup=()
# Microsoft's mup (--dev), which tests/test_mup.py compares hopperlm's μP multipliers with: installed without its
# dependencies, as its optimizers and shapes need only torch and pyyaml (its torchvision pin would replace the
# CPU torch)
[ "${1:-}" = "--dev" ] && extras="dev" mup=("mup==1.0.0")
# A failed pip fails the script (pipefail); only pip's warning about running as root is hidden. pip compiles
# what it installs to bytecode one file at a time (half of a fresh install's two minutes here): --no-compile, then
# compile_installed below does it on every core.
pip_install() { "$PY" -m pip install -q --no-compile "$@" 2>&1 | { grep -v "Running pip as the 'root' user" || true; }; }
# Bytecode for the environment's packages, on every core (compileall -j 0), as pip would have written it. Without
# it every process would compile torch again where PYTHONDONTWRITEBYTECODE is set (CI's machines set it). A file
# that does not compile (some packages ship Python 2 examples) is skipped, as pip skips it; so are the packages' own
# test folders (3,700 of 17,600 files, nothing imports them: 29 s instead of 42 here).
compile_installed() {
  "$PY" -m compileall -qq -j 0 -x '/tests?/' "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    || true
}

# PyTorch's own index of CPU-only wheels; a short probe, so an offline machine falls back in seconds
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
cpu_index_reachable() {
  "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/torch/", timeout=5).close()' \
    "$TORCH_CPU_INDEX" >/dev/null 2>&1
}

if ! "$PY" -c "import torch, sys; sys.exit(tuple(map(int, torch.__version__.split('.')[:2])) < (2, 11))" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found; installing torch with CUDA from the package index"
    pip_install "torch>=2.11"
  elif [ "$(uname -s)" = Linux ] && cpu_index_reachable; then
    echo "setup: no NVIDIA GPU found; installing torch 2.13.0's CPU build from PyTorch's CPU wheel index ($TORCH_CPU_INDEX)"
    pip_install "torch==2.13.0+cpu" --extra-index-url "$TORCH_CPU_INDEX"
  else
    echo "setup: no NVIDIA GPU found; PyTorch's CPU wheel index is not reachable (or not needed off Linux): installing" \
      "torch 2.13.0 from the package index, whichever build it serves (on Linux from the public index: the CUDA build, several GB)"
    pip_install "torch==2.13.0"
  fi
  installed=1
fi
# pip's no-op pass over ~100 installed packages takes 13 s: skipped when everything asked for is already there
if "$PY" scripts/installed.py --extras "$extras" ${mup[@]+"${mup[@]}"}; then
  echo "setup: every requirement (with [$extras]) is installed already, hopperlm editable from here"
else
  pip_install -e ".[${extras}]"
  if [ ${#mup[@]} -gt 0 ]; then
    pip_install --no-deps "${mup[@]}"
  fi
  installed=1
fi
if [ "${installed:-0}" = 1 ]; then compile_installed; fi
command -v pyenv >/dev/null 2>&1 && pyenv rehash 2>/dev/null || true  # make the `hopperlm` command visible
"$PY" -c "import hopperlm, torch; print(f'setup: hopperlm {hopperlm.__version__} with torch {torch.__version__}'
          f' ({\"CUDA \" + torch.version.cuda if torch.version.cuda else \"CPU-only\"} build)')"
