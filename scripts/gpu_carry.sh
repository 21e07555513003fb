#!/usr/bin/env bash
# Prepare, on this CPU machine, what the GPU machine's image lacks for bench/gpu/campaign.sh, into the one
# git-ignored folder gpu-carry/ that both device calls (A, then B) name in `carry`; then check, with no device
# time, that the campaign runs under the GPU image's versions. Prints each part's size and the total.
#   gpu-carry/whl/    torchao 0.18.0 (float8, 8-bit AdamW), bitsandbytes 0.50.2 rebuilt with only its CUDA 13
#                     and CPU libraries (41 MiB -> ~3.5 MiB: the image has CUDA 13; the others never load there),
#                     and liger-kernel 0.8.5 (pure Python Triton kernels: the `train.kernels liger` rows; the image
#                     has triton)
#   gpu-carry/data/   Tiny Shakespeare, TinyLlama's tokenizer, the Alpaca demo, HornMT: what the GPU tests read
#   gpu-carry/gutenberg-32k/  Gutenberg books prepared with TinyLlama's tokenizer.json (the Llama-2 vocabulary,
#                     32,000 pieces): owt-350m and the profile train on it
#   gpu-carry/stamp.json  the commit, whether the tree had uncommitted changes, and a digest of the code files
#                     (hopperlm/provenance.py): the GPU machine's records take their commit from it where the
#                     digest matches the tree that ran. `--stamp` rewrites only this file (a second): run it
#                     right before every device call, after the last edit
# Then (unless --no-drift-check) a throwaway venv with the GPU image's torch 2.11 and transformers 5.17 runs
# `campaign.sh --smoke` for calls E, F, A, B and D, and this script stops on any failure: what broke on 2.11
# breaks here, for free. (PyPI's torch 2.11 is the CUDA build; without a GPU it runs on the CPU, the same Python
# code.)
#
#   bash scripts/gpu_carry.sh [--books-mb MB] [--no-drift-check]
#   bash scripts/gpu_carry.sh --stamp
#   bash scripts/gpu_carry.sh --call-r     gpu-carry-r/books.tar.xz: every Gutenberg book, xz-packed (~17 MB),
#                                          for call R (bench/gpu/race_r.py), carried beside gpu-carry/
#
# Needs the package index (pip download/install) and the shared data ($HOPPERLM_DATA_DIR, else ../shared/data).
set -euo pipefail
cd "$(dirname "$0")/.."
BOOKS_MB=40 LIMIT_MIB=64 DRIFT=1 STAMP_ONLY=0 CALL_R=0
while [ $# -gt 0 ]; do
  case $1 in
    --books-mb) BOOKS_MB=$2; shift ;;
    --no-drift-check) DRIFT=0 ;;
    --stamp) STAMP_ONLY=1 ;;
    --call-r) CALL_R=1 ;;
    -h|--help) sed -n '/^#   bash/p' "$0" | sed 's/^#  //'; exit 0 ;;
    *) echo "gpu_carry: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
DATA=${HOPPERLM_DATA_DIR:-$(cd .. && pwd)/shared/data}
PY=${PYTHON:-python3}
stamp() {  # gpu-carry/stamp.json: what the device call's records will call this tree
  "$PY" -c 'from hopperlm.provenance import write_stamp; s = write_stamp()
print("gpu_carry: stamped", s["commit"], "+ uncommitted changes" if s["dirty"] else "", "tree", s["tree"])'
}
if [ "$CALL_R" = 1 ]; then  # call R's books, packed (the device tool carries 64 MiB in all)
  grep -qx '/gpu-carry-r/' .gitignore || { echo "gpu_carry: /gpu-carry-r/ must be in .gitignore" >&2; exit 1; }
  mkdir -p gpu-carry-r
  (cd "$DATA/gutenberg" && tar -cJf - pg*.txt) > gpu-carry-r/books.tar.xz.part
  mv gpu-carry-r/books.tar.xz.part gpu-carry-r/books.tar.xz
  echo "gpu_carry: gpu-carry-r/books.tar.xz $(du -sb gpu-carry-r/books.tar.xz | awk '{printf "%.1f MiB", $1 / 1048576}');" \
    "with gpu-carry/ $(du -sbc gpu-carry gpu-carry-r | tail -1 | awk '{printf "%.1f MiB", $1 / 1048576}') of $LIMIT_MIB MiB"
  exit 0
fi
if [ "$STAMP_ONLY" = 1 ]; then
  [ -d gpu-carry ] || { echo "gpu_carry: no gpu-carry/ yet; run bash scripts/gpu_carry.sh first" >&2; exit 2; }
  stamp; exit 0
fi
# torchao: 0.18.0, by evidence. Its float8 training ran on the GPU image's torch 2.11 on 2026-11-22 (H200,
# bench/results/2026-11-22-h200: tinyllama-1.1b 1.18x bf16), and it is what CI and the dev machines run on
# torch 2.13, so the smoke checks the same code the GPU runs. 0.17 (listed as built for 2.11) also converts and
# steps float8 layers and 8-bit AdamW on 2.11 on the CPU, but has never run on the GPU here.
TORCHAO=torchao==0.18.0 BNB=bitsandbytes==0.50.2  # bitsandbytes 0.50.2 ships libbitsandbytes_cuda130.so
LIGER=liger-kernel==0.8.5  # needs torch and triton, both in the GPU image; never installed on the CPU path
GPU_IMAGE="torch==2.11.0 transformers==5.17.0 accelerate==1.15.0"  # /work/.library/device/KINDS.md
grep -qx '/gpu-carry/' .gitignore || { echo "gpu_carry: /gpu-carry/ must be in .gitignore" >&2; exit 1; }

wheels() {  # DEST NAME==VERSION...: Python 3.12 wheels for the GPU machine (the device README's command)
  local dest=$1; shift
  mkdir -p "$dest"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$dest" "$@"
}

trim_bitsandbytes() {  # WHEEL: keep only the CUDA 13.0 and CPU libraries, RECORD rewritten to match
  "$PY" - "$1" <<'EOF'
import sys, zipfile
from pathlib import Path

wheel = Path(sys.argv[1])
keep = ("libbitsandbytes_cuda130.so", "libbitsandbytes_cpu.so")
trimmed = wheel.with_suffix(".trimmed")
with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as dst:
    names = [n for n in src.namelist() if not (n.endswith(".so") and Path(n).name not in keep)]
    for name in names:
        data = src.read(name)
        if name.endswith(".dist-info/RECORD"):  # pip reads RECORD to uninstall: list only what is there
            lines = data.decode().splitlines()
            data = ("\n".join(l for l in lines if l.split(",")[0] in names) + "\n").encode()
        dst.writestr(src.getinfo(name), data)
    if not all(any(n.endswith(k) for n in names) for k in keep):
        sys.exit(f"gpu_carry: {wheel.name} lacks one of {keep}: pin a bitsandbytes that ships CUDA 13.0")
trimmed.replace(wheel)
EOF
}

test_data() {  # DEST: what the GPU tests read from $HOPPERLM_DATA_DIR (tests/test_gpu_campaign.py checks the list)
  mkdir -p "$1/tokenizers"
  cp -r "$DATA/tinyshakespeare" "$DATA/alpaca_gpt4_demo" "$DATA/hornmt" "$1/"
  cp -r "$DATA/tokenizers/tinyllama-1.1b-chat-v1.0" "$1/tokenizers/"
}

gutenberg() {  # DEST: the first books (by Project Gutenberg number) up to BOOKS_MB of text
  local books=() total=0 size
  for f in "$DATA"/gutenberg/pg*.txt; do
    size=$(stat -c %s "$f")
    [ $((total + size)) -gt $((BOOKS_MB * 1000000)) ] && break
    books+=("$f"); total=$((total + size))
  done
  echo "gpu_carry: ${#books[@]} Gutenberg books, $((total / 1000000)) MB of text -> $1"
  "$PY" -m hopperlm prepare "${books[@]}" --out "$1" --overwrite \
    --tokenizer "$DATA/tokenizers/tinyllama-1.1b-chat-v1.0/tokenizer.json" | tail -1
}

tree_bytes() {  # what travels besides the carry: tracked files and untracked ones git does not ignore
  "$PY" -c 'import os, subprocess
names = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], capture_output=True).stdout
print(sum(os.path.getsize(n) for n in names.split(b"\0") if n and os.path.isfile(n)))'
}

mib() { echo "$1" | awk '{printf "%.1f MiB", $1 / 1048576}'; }

dest=gpu-carry
rm -rf "$dest"; mkdir -p "$dest"
wheels "$dest/whl" "$TORCHAO" "$BNB" "$LIGER"
trim_bitsandbytes "$(ls "$dest"/whl/bitsandbytes-*.whl)"
test_data "$dest/data"
gutenberg "$dest/gutenberg-32k"
stamp

total=$(tree_bytes)
echo "gpu_carry: what travels with each device call"
printf '  %-40s %10s\n' "the working tree (git ls-files)" "$(mib "$total")"
for part in "$dest"/whl/*.whl "$dest/data" "$dest/gutenberg-32k" "$dest/stamp.json"; do
  size=$(du -sb "$part" | cut -f1)
  total=$((total + size))
  printf '  %-40s %10s\n' "$(basename "${part}" | cut -c1-40)" "$(mib "$size")"
done
printf '  %-40s %10s of %d MiB\n' "total" "$(mib "$total")" "$LIMIT_MIB"
if [ "$total" -ge $((LIMIT_MIB * 1048576)) ]; then
  echo "gpu_carry: over the device tool's $LIMIT_MIB MiB; lower --books-mb" >&2; exit 1
fi

[ "$DRIFT" = 1 ] || { echo "gpu_carry: version-drift check skipped (--no-drift-check)"; exit 0; }
# The GPU image's versions, on the CPU: a throwaway venv (pip's cache makes a second run quick)
VENV=$(mktemp -d)
trap 'rm -rf "$VENV"' EXIT
echo "gpu_carry: drift check: a venv with $GPU_IMAGE (about a minute to install) ..."
"$PY" -m venv "$VENV/venv"
VPY=$VENV/venv/bin/python
"$VPY" -m pip install -q -e ".[dev]" $GPU_IMAGE 2>&1 | grep -v "Running pip as the 'root' user" || true
"$VPY" -c "import torch, transformers; print(f'gpu_carry: drift check with torch {torch.__version__}, transformers {transformers.__version__}')"
for call in E F A B D; do
  out=$VENV/smoke-$call
  if ! PYTHON=$VPY HOPPERLM_DATA_DIR=$DATA bash bench/gpu/campaign.sh --smoke --call $call "$out" > "$VENV/smoke-$call.log" 2>&1; then
    tail -n 30 "$VENV/smoke-$call.log"
    cp "$VENV/smoke-$call.log" "$dest/drift-check-call-$call.log"
    echo "gpu_carry: call $call's smoke run FAILED under $GPU_IMAGE (log: $dest/drift-check-call-$call.log); fix it before spending device time" >&2
    exit 1
  fi
  grep -E "stages ok" "$VENV/smoke-$call.log" | sed "s/^/gpu_carry: call $call smoke under torch 2.11: /"
done
echo "gpu_carry: ready: carry [\"gpu-carry\"] with each device call (bench/gpu/README.md)"
