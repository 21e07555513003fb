#!/usr/bin/env bash
# GPU call 4: time to val loss 1.4697 on Tiny Shakespeare with the shakespeare-char-gpu recipe as shipped
# (2,000-step cosine, CUDA graphs chosen by the plan) and a 1,500-step variant; h100-350m with autotuning.
source bench/gpu/env.sh
hl prepare "$HOPPERLM_DATA_DIR/tinyshakespeare/input.txt" --out /tmp/shakespeare-byte > /dev/null
speedrun() {  # NAME OVERRIDES...: wall time of the whole command, start-up and compile included
  local name=$1; shift
  local t0=$(date +%s.%N)
  timeout 100 python3 -m hopperlm train shakespeare-char-gpu --data.path /tmp/shakespeare-byte \
    --run.out_dir /tmp/run-$name "$@" > "$OUT/speedrun-$name.log" 2>&1
  local rc=$? t1=$(date +%s.%N)
  echo "speedrun $name: rc $rc, $(python3 -c "print(f'{$t1 - $t0:.1f}')") s wall | $(grep -E '^done' "$OUT/speedrun-$name.log")"
}
{
speedrun recipe
speedrun steps1500 --train.max_steps 1500
} 2>&1 | tee "$OUT/speedrun2.txt"
timeout 150 python3 -m hopperlm bench --presets h100-350m --no-hf --windows 3 \
  --variant "mb64:micro_batch=64" --variant "mb64-autotune:micro_batch=64,compile_mode=max-autotune-no-cudagraphs" \
  --out "$OUT/bench-h100-350m-autotune.json" > "$OUT/bench-h100-350m-autotune.log" 2>&1
grep -A8 "^preset" "$OUT/bench-h100-350m-autotune.log" | tee "$OUT/bench-h100-350m-autotune.txt"
