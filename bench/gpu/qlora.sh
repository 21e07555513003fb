#!/usr/bin/env bash
# The QLoRA/LoRA targets on a Llama-2-7B shape, hopperlm beside transformers + peft + bitsandbytes (QLoRA peak
# memory <= 10 GB; LoRA tokens/s >= 1.5x transformers + peft), and the CUDA-only QLoRA test (training with paged
# 8-bit AdamW). Run from the repository root on the GPU machine: bash bench/gpu/qlora.sh (files go to $OUT).
# The device is offline: carry the wheels first (they install with --no-deps, torch is the device's own):
#   pip download --no-deps bitsandbytes peft accelerate -d gpu-carry/whl
# and gpu-carry/data (the test reads tinyshakespeare/ and tokenizers/tinyllama-1.1b-chat-v1.0/).
source bench/gpu/env.sh
python3 -m pytest -q -m gpu tests/test_qlora.py 2>&1 | tail -5 | tee "$OUT/gpu-tests-qlora.txt"
# four rows, each in its own process; the random 7B checkpoint (13.5 GB bf16) is written once to /tmp
timeout 1500 python3 bench/gpu/qlora.py --out "$OUT/qlora.json" > "$OUT/qlora.log" 2>&1
tail -6 "$OUT/qlora.log" | tee "$OUT/qlora.txt"
