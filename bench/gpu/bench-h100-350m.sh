#!/usr/bin/env bash
# `hopperlm bench` for h100-350m at seq 1024 (hopperlm beside eager PyTorch and HF transformers), with variants
# that show what each choice is worth: whole-model compile, the standard loss instead of the fused one,
# micro-batch 32 and 64.
# Carry: the torchao wheel in gpu-carry/whl (bench/gpu/env.sh installs it).
# Run from the repository root on the GPU machine: bash bench/gpu/bench-h100-350m.sh (files go to $OUT).
source bench/gpu/env.sh
hl bench --presets h100-350m --out "$OUT/bench-h100-350m.json" \
  --variant "scope-model:compile_scope=model" --variant "standard-loss:fused_loss=false" \
  --variant "mb32:micro_batch=32" --variant "mb64:micro_batch=64" 2>&1 | tee "$OUT/bench-h100-350m.txt"
