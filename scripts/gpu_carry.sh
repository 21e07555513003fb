#!/usr/bin/env bash
# Prepare, on this CPU machine, what the GPU machine's image lacks for bench/gpu/campaign.sh, into the
# git-ignored gpu-carry/ (one folder per device call, each named in that call's `carry`):
#   gpu-carry/call1  whl/ torchao 0.18.0 (the release built for torch 2.11: float8, 8-bit AdamW);
#                    data/ (Tiny Shakespeare, TinyLlama's tokenizer, the Alpaca demo: what the GPU tests read);
#                    gutenberg-32k/ (Gutenberg books prepared with `hopperlm prepare` and TinyLlama's tokenizer.json,
#                    the Llama-2 vocabulary of 32,000 pieces: owt-350m and the profile train on it); COMMIT
#   gpu-carry/call2  whl/ torchao 0.18.0 and bitsandbytes (QLoRA); data/ as above; COMMIT
# accelerate, peft and transformers are on the GPU image already (/work/.library/device/KINDS.md). Each call's
# working tree (this repository's files + its carry) must stay under the device tool's 64 MiB: checked here.
#
#   bash scripts/gpu_carry.sh [--call 1|2] [--books-mb MB]
#
# Needs the network (pip download) and the shared data ($HOPPERLM_DATA_DIR, else ../shared/data).
set -euo pipefail
cd "$(dirname "$0")/.."
CALLS="1 2" BOOKS_MB=48 LIMIT_MIB=64
while [ $# -gt 0 ]; do
  case $1 in
    --call) CALLS=$2; shift ;;
    --books-mb) BOOKS_MB=$2; shift ;;
    -h|--help) sed -n '/^#   bash/p' "$0" | sed 's/^#  //'; exit 0 ;;
    *) echo "gpu_carry: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
DATA=${HOPPERLM_DATA_DIR:-$(cd .. && pwd)/shared/data}
PY=${PYTHON:-python3}
TORCHAO=torchao==0.18.0 BNB=bitsandbytes==0.50.2  # bitsandbytes 0.50.2 ships libbitsandbytes_cuda130.so
grep -qx '/gpu-carry/' .gitignore || { echo "gpu_carry: /gpu-carry/ must be in .gitignore" >&2; exit 1; }

wheels() {  # DEST NAME==VERSION...: Python 3.12 wheels for the GPU machine (the device README's command)
  local dest=$1; shift
  mkdir -p "$dest"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$dest" "$@"
}

test_data() {  # DEST: what the GPU tests read from $HOPPERLM_DATA_DIR
  mkdir -p "$1/tokenizers"
  cp -r "$DATA/tinyshakespeare" "$DATA/alpaca_gpt4_demo" "$1/"
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

for call in $CALLS; do
  dest=gpu-carry/call$call
  rm -rf "$dest"; mkdir -p "$dest"
  if [ "$call" = 1 ]; then
    wheels "$dest/whl" "$TORCHAO"
    gutenberg "$dest/gutenberg-32k"
  else
    wheels "$dest/whl" "$TORCHAO" "$BNB"
  fi
  test_data "$dest/data"
  commit=$(git rev-parse --short HEAD)
  if [ -n "$(git status --porcelain --untracked-files=no)" ]; then commit="$commit + uncommitted changes"; fi
  echo "$commit" > "$dest/COMMIT"
  carry=$(du -sb "$dest" | cut -f1) tree=$(tree_bytes)
  total=$((carry + tree))
  printf 'gpu_carry: %s %.1f MiB + the working tree %.1f MiB = %.1f MiB of %d MiB\n' "$dest" \
    "$(echo "$carry / 1048576" | bc -l)" "$(echo "$tree / 1048576" | bc -l)" "$(echo "$total / 1048576" | bc -l)" "$LIMIT_MIB"
  if [ "$total" -ge $((LIMIT_MIB * 1048576)) ]; then
    echo "gpu_carry: call $call is over the device tool's $LIMIT_MIB MiB; lower --books-mb" >&2; exit 1
  fi
done
