#!/usr/bin/env bash
# `hopperlm bench` for tinyllama-1.1b at seq 2048 (bf16 and float8 beside eager PyTorch and HF transformers);
# bf16 and float8 also train 200 steps on real text from the same initialisation to compare their losses.
# Carry: gpu-carry/gutenberg-llama2 (Gutenberg books prepared with `hopperlm prepare` and TinyLlama's
# tokenizer) and the torchao wheel in gpu-carry/whl (bench/gpu/env.sh installs it).
# Run from the repository root on the GPU machine: bash bench/gpu/bench-tinyllama-1.1b.sh (files go to $OUT).
source bench/gpu/env.sh
hl bench --presets tinyllama-1.1b --loss-steps 200 --data gpu-carry/gutenberg-llama2 \
  --out "$OUT/bench-tinyllama-1.1b.json" 2>&1 | tee "$OUT/bench-tinyllama-1.1b.txt"
