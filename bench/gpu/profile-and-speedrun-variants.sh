#!/usr/bin/env bash
# A profile of h100-350m training steps (kernel table + Chrome trace); wall time to val loss 1.4697 on Tiny
# Shakespeare from a cold start (compile included) for three variants of shakespeare-char-gpu (nanoGPT's shape,
# micro-batch 128 with lr 2e-3, CUDA graphs); `hopperlm bench` for h100-350m at micro-batch 64 with and
# without autotuned compile (max-autotune-no-cudagraphs).
# Carry: gpu-carry/data (tinyshakespeare/input.txt) and the torchao wheel in gpu-carry/whl.
# Run from the repository root on the GPU machine: bash bench/gpu/profile-and-speedrun-variants.sh (files go to $OUT).
source bench/gpu/env.sh
python3 bench/gpu/profile_step.py h100-350m --micro-batch 16 --seq-len 1024 --steps 5 \
  --trace "$OUT/trace-h100-350m.json.gz" 2>&1 | tee "$OUT/profile-h100-350m.txt"
hl prepare "$HOPPERLM_DATA_DIR/tinyshakespeare/input.txt" --out /tmp/shakespeare-byte > /dev/null
{
speedrun nanogpt-shape
speedrun mb128-lr2e-3 --train.micro_batch 128 --optim.lr 2e-3 --train.max_steps 2500
speedrun cudagraphs --train.compile_mode reduce-overhead
} 2>&1 | tee "$OUT/speedrun.txt"
timeout 150 python3 -m hopperlm bench --presets h100-350m --no-hf --windows 3 \
  --variant "mb64:micro_batch=64" --variant "mb64-autotune:micro_batch=64,compile_mode=max-autotune-no-cudagraphs" \
  --out "$OUT/bench-h100-350m-autotune.json" 2>&1 | tail -8 | tee "$OUT/bench-h100-350m-autotune.txt"
