#!/usr/bin/env bash
# Wall time to val loss 1.4697 on Tiny Shakespeare with the shakespeare-char-gpu recipe as shipped (2,000-step
# cosine, CUDA graphs chosen by the plan) and with a 1,500-step cosine; `hopperlm bench` for h100-350m at
# micro-batch 64 with and without autotuned compile (max-autotune-no-cudagraphs).
# Carry: gpu-carry/data (tinyshakespeare/input.txt) and the torchao wheel in gpu-carry/whl.
# Run from the repository root on the GPU machine: bash bench/gpu/speedrun-recipe-and-autotune.sh (files go to $OUT).
source bench/gpu/env.sh
hl prepare "$HOPPERLM_DATA_DIR/tinyshakespeare/input.txt" --out /tmp/shakespeare-byte > /dev/null
export SPEEDRUN_TIMEOUT=100
{
speedrun recipe
speedrun steps1500 --train.max_steps 1500
} 2>&1 | tee "$OUT/speedrun2.txt"
timeout 150 python3 -m hopperlm bench --presets h100-350m --no-hf --windows 3 \
  --variant "mb64:micro_batch=64" --variant "mb64-autotune:micro_batch=64,compile_mode=max-autotune-no-cudagraphs" \
  --out "$OUT/bench-h100-350m-autotune.json" > "$OUT/bench-h100-350m-autotune.log" 2>&1
grep -A8 "^preset" "$OUT/bench-h100-350m-autotune.log" | tee "$OUT/bench-h100-350m-autotune.txt"
