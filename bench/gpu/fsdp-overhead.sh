#!/usr/bin/env bash
# What DDP and FSDP2 wrapping cost on one GPU (tinyllama-1.1b, 8 x 2048, the plan's compile; the unwrapped row
# is the baseline measured in the same process), and the GPU test that trains with FSDP2 (bf16 params, fp32
# reduction) in a group of one.
# Carry: gpu-carry/data (tinyshakespeare/input.txt, which the test trains on) and the torchao wheel in
# gpu-carry/whl (bench/gpu/env.sh installs it).
# Run from the repository root on the GPU machine: bash bench/gpu/fsdp-overhead.sh (files go to $OUT).
# On a node with 8 GPUs, run instead
#   torchrun --standalone --nproc-per-node 8 bench/gpu/fsdp_overhead.py --presets tinyllama-1.1b,llama3-8b
# for the per-GPU numbers of the README's scaling note.
source bench/gpu/env.sh
python3 bench/gpu/fsdp_overhead.py --presets tinyllama-1.1b --out "$OUT/fsdp-overhead-1gpu.json" 2>&1 \
  | tee "$OUT/fsdp-overhead-1gpu.txt"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_dist.py 2>&1 | tail -5 | tee "$OUT/dist-gpu-tests.txt"
