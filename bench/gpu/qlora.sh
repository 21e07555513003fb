#!/usr/bin/env bash
# GPU: issue 6's targets on a Llama-2-7B shape (QLoRA peak memory <= 10 GB; LoRA tokens/s >= 1.5x
# transformers + peft), side by side, and issue 6's CUDA-only tests (QLoRA training with paged 8-bit AdamW).
# The device is offline: carry the wheels first (they install with --no-deps, torch is the device's own):
#   pip download --no-deps bitsandbytes peft accelerate -d gpu-carry/whl
source bench/gpu/env.sh
python3 -m pytest -q -m gpu tests/test_qlora.py 2>&1 | tail -5 | tee "$OUT/gpu-tests-issue6.txt"
# four rows, each in its own process; the random 7B checkpoint (13.5 GB bf16) is written once to /tmp
timeout 1500 python3 bench/gpu/qlora.py --out "$OUT/qlora.json" > "$OUT/qlora.log" 2>&1
tail -6 "$OUT/qlora.log" | tee "$OUT/qlora.txt"
