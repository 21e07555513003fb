#!/usr/bin/env bash
# GPU call 2a: the bench for h100-350m at seq 1024, with variants that show what each choice is worth.
source bench/gpu/env.sh
hl bench --presets h100-350m --out "$OUT/bench-h100-350m.json" \
  --variant "scope-model:compile_scope=model" --variant "standard-loss:fused_loss=false" \
  --variant "mb32:micro_batch=32" --variant "mb64:micro_batch=64" 2>&1 | tee "$OUT/bench-h100-350m.txt"
