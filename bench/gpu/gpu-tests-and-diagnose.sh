#!/usr/bin/env bash
# The GPU-only tests (memory estimate vs measured peak, device self-test), an SDPA check of which attention
# kernels take grouped-query attention (enable_gqa), `hopperlm diagnose` with the micro-batch finder for
# h100-350m (seq 1024) and tinyllama-1.1b (seq 2048), and `hopperlm bench` for gpt2-124m.
# Carry: the torchao wheel in gpu-carry/whl (bench/gpu/env.sh installs it); no data (diagnose plans with
# a 32000 vocabulary when the recipe's data is not prepared).
# Run from the repository root on the GPU machine: bash bench/gpu/gpu-tests-and-diagnose.sh (files go to $OUT).
source bench/gpu/env.sh
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_memory.py tests/test_selftest.py 2>&1 | tail -15 | tee "$OUT/gpu-tests.txt"
python3 - <<'PY' 2>&1 | tee "$OUT/sdpa-gqa.txt"
import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
q = torch.randn(8, 32, 2048, 64, device="cuda", dtype=torch.bfloat16)
kv = torch.randn(8, 4, 2048, 64, device="cuda", dtype=torch.bfloat16)
for name, b in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
    try:
        with sdpa_kernel([b]):
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        print(f"gqa via enable_gqa with {name}: ok")
    except RuntimeError as e:
        print(f"gqa via enable_gqa with {name}: FAILS ({str(e).splitlines()[0][:120]})")
PY
for preset in h100-350m tinyllama-1.1b; do
  seq=1024; [ $preset = tinyllama-1.1b ] && seq=2048
  hl diagnose configs/owt-350m-h100.yaml --model.preset $preset --model.max_seq_len $seq --train.seq_len $seq \
    --train.batch_tokens $((seq * 256)) --train.max_hours 1.5 --run.out_dir /tmp/diag-$preset 2>&1 | tee "$OUT/diagnose-$preset.txt"
done
hl bench --presets gpt2-124m --windows 3 --out "$OUT/bench-gpt2-124m.json" 2>&1 | tee "$OUT/bench-gpt2-124m.txt"
