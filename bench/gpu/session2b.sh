#!/usr/bin/env bash
# GPU call 2b: the bench for tinyllama-1.1b at seq 2048; bf16 and float8 also train 200 steps on real text
# (Gutenberg, TinyLlama tokenizer) from the same initialisation to compare their losses.
source bench/gpu/env.sh
hl bench --presets tinyllama-1.1b --loss-steps 200 --data gpu-carry/gutenberg-llama2 \
  --out "$OUT/bench-tinyllama-1.1b.json" 2>&1 | tee "$OUT/bench-tinyllama-1.1b.txt"
