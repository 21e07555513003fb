#!/usr/bin/env bash
# One call, all the GPU evidence, in order of value: each stage under its own time limit (`timeout`), each
# writing OUT/<stage>.json ({"stage", "ok", "seconds", "key", ...}) the moment it ends (a time-out loses only
# the stage in flight), then one summary table (stage, ok, seconds, key numbers). Exits 1 if any stage failed.
#
#   bash bench/gpu/campaign.sh [--smoke] [--call 1|2] [--only STAGE,...] [--bring DIR] OUT
#
#   call 1  gpu-tests            pytest -m gpu (the GPU-only tests)
#           bench-h100-350m      hopperlm bench: eager, hopperlm bf16 and float8 (the real training step), HF
#           cudagraphs-accum     (b) CUDA graphs + gradient accumulation: finite losses, or a clean refusal
#           flash-ac-finder      (d) forced flash attention + full activation checkpointing + micro-batch finder
#           owt-350m             40 steps of configs/owt-350m-h100.yaml on Gutenberg (32K tokens) end to end
#           profile-h100-350m    hopperlm profile of h100-350m steps, with --memory-snapshot
#   call 2  qlora                bench/gpu/qlora.py: QLoRA/LoRA on a Llama-2-7B shape vs transformers + peft
#           gpu-tests-qlora      pytest -m gpu tests/test_qlora.py (needs the carried bitsandbytes)
#           fsdp-overhead        bench/gpu/fsdp_overhead.py: DDP and FSDP2 wrapping on one GPU
#           bench-tinyllama-1.1b hopperlm bench: eager, hopperlm bf16 and float8, HF
# Without --call: both calls' stages. --smoke: every stage on the CPU at tiny sizes, CPU stand-ins where a
# kernel needs CUDA (labelled so); no carry, no network; CI runs it (tests/test_gpu_campaign.py). Smoke
# numbers are never measurements: OUT may not be under bench/results/.
# On the GPU machine the carry comes from gpu-carry/callN (scripts/gpu_carry.sh), and each call must end by
# ~560 s (the device tool's 600 s): a stage starts only with CAMPAIGN_BUDGET_S (550 per call) left for it.
# --bring DIR: after every stage, DIR gets campaign-callN.tar.gz (all of OUT but work/) and summary-callN.txt,
# two files for the device tool's $OUT (which brings back 8 at most). The exact device calls:
# bench/gpu/README.md. Test hook: CAMPAIGN_BREAK="STAGE=fail,STAGE=hang" breaks those stages on purpose.
set -uo pipefail

CALL1="gpu-tests:90 bench-h100-350m:150 cudagraphs-accum:75 flash-ac-finder:90 owt-350m:170 profile-h100-350m:60"
CALL2="qlora:360 gpu-tests-qlora:50 fsdp-overhead:110 bench-tinyllama-1.1b:110"
SMOKE_LIMIT=150  # seconds per stage in --smoke (a busy 2-core CI machine)

# ---- the stages: each runs as `bash campaign.sh --stage-body NAME` under `timeout`, writing into $W ----------
tiny_train() {  # the tiny stand-in of a recipe's model in --smoke
  echo --model.dim 64 --model.n_layers 2 --model.n_heads 2 --model.n_kv_heads 1 --model.ffn_dim 128 \
    --model.max_seq_len 64 --train.seq_len 64
}
shakespeare() {  # Tiny Shakespeare as bytes, prepared once per campaign
  local out=$OUT/work/shakespeare-byte
  [ -f "$out/manifest.json" ] || $PY -m hopperlm prepare "$DATA/tinyshakespeare/input.txt" --out "$out" >&2 || return 1
  echo "$out"
}
gutenberg() {  # English books with the Llama-2 vocabulary (TinyLlama's tokenizer.json, 32,000 pieces)
  if [ "$SMOKE" = 0 ]; then echo "$CARRY/gutenberg-32k"; return; fi
  local out=$OUT/work/gutenberg-32k
  [ -f "$out/manifest.json" ] || $PY -m hopperlm prepare "$DATA/gutenberg/pg01952_The_Yellow_Wallpaper.txt" \
    --tokenizer "$DATA/tokenizers/tinyllama-1.1b-chat-v1.0/tokenizer.json" --out "$out" >&2 || return 1
  echo "$out"
}
gpu_test_files() { grep -l "mark.gpu" tests/test_*.py; }

stage_gpu_tests() {
  $PY -m pytest -q -m gpu -p no:cacheprovider $(gpu_test_files) -k "not qlora_trains_on_cuda"
}
stage_gpu_tests_qlora() { $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_qlora.py; }

bench() {  # PRESET ARGS...
  local preset=$1; shift
  if [ "$SMOKE" = 1 ]; then set -- --quick --device cpu --steps 1 --windows 1 --warmup 1; fi
  $PY -m hopperlm bench --presets "$preset" --out "$W/bench.json" "$@"
}
stage_bench_h100_350m() { bench h100-350m --windows 3; }
stage_bench_tinyllama_1_1b() { bench tinyllama-1.1b --windows 3 --no-hf-compile; }

stage_cudagraphs_accum() {  # micro-batch 16 x 4 accumulation steps under CUDA graphs (reduce-overhead)
  local data size=(--train.micro_batch 16 --train.batch_tokens $((16 * 256 * 4)) --train.max_steps 30)
  data=$(shakespeare) || return 1
  [ "$SMOKE" = 1 ] && size=($(tiny_train) --train.micro_batch 2 --train.batch_tokens 512 --train.max_steps 4)
  $PY -m hopperlm train shakespeare-char-gpu --data.path "$data" --train.compile_mode reduce-overhead \
    "${size[@]}" --train.target_loss null --train.eval_every 0 --train.eval_windows 4 --train.log_every 2 \
    --train.ckpt_every 0 --log.report false --log.tensorboard false --run.out_dir "$W/run"
}
stage_flash_ac_finder() {  # train.micro_batch unset: the finder's trial steps run with the forced kernel and AC
  local data attention=flash size=(--train.max_steps 20)
  data=$(shakespeare) || return 1
  # on a CPU only math can be forced (flash and cudnn are CUDA kernels): the stand-in of the same code path
  [ "$SMOKE" = 1 ] && attention=math size=($(tiny_train) --train.max_steps 4)
  $PY -m hopperlm train shakespeare-char-gpu --data.path "$data" --train.attention $attention \
    --train.activation_checkpointing full --train.micro_batch null "${size[@]}" --train.target_loss null \
    --train.eval_every 0 --train.eval_windows 4 --train.log_every 2 --train.ckpt_every 0 \
    --log.report false --log.tensorboard false --run.out_dir "$W/run"
}
stage_owt_350m() {  # the recipe as shipped (batch 262,144 tokens, micro-batch by the finder) but for the
  # budget: 40 steps, a short eval, LR warm-up 10 steps instead of 500 so that the loss moves
  local data size=(--train.max_steps 40 --train.eval_every 20 --train.eval_windows 20 --train.log_every 5)
  data=$(gutenberg) || return 1
  [ "$SMOKE" = 1 ] && size=(--model.preset debug --model.max_seq_len 64 --train.seq_len 64
    --train.batch_tokens 256 --train.max_steps 4 --train.eval_every 2 --train.eval_windows 2 --train.log_every 2)
  $PY -m hopperlm train configs/owt-350m-h100.yaml --data.path "$data" --train.target_loss null \
    --optim.warmup_steps 10 --train.ckpt_every 0 "${size[@]}" --run.out_dir "$W/run"
}
stage_profile_h100_350m() {
  local data size=(--model.max_seq_len 1024 --train.seq_len 1024 --train.micro_batch 16 --train.batch_tokens 16384)
  data=$(gutenberg) || return 1
  [ "$SMOKE" = 1 ] && size=(--model.preset debug --model.max_seq_len 64 --train.seq_len 64 --train.micro_batch 2
    --train.batch_tokens 128)
  $PY -m hopperlm profile configs/owt-350m-h100.yaml --data.path "$data" "${size[@]}" --steps 3 --wait 1 \
    --warmup 1 --memory-snapshot --out "$W/profile" --run.out_dir "$W/run"
}
stage_qlora() {
  if [ "$SMOKE" = 1 ]; then
    $PY bench/gpu/qlora.py --smoke --base "$OUT/work/llama2-random" --out "$W/qlora.json"
  else  # the random 7B checkpoint (13.5 GB bf16) is written once to /tmp
    $PY bench/gpu/qlora.py --warmup 2 --steps 5 --row-timeout 85 --out "$W/qlora.json"
  fi
}
stage_fsdp_overhead() {
  if [ "$SMOKE" = 1 ]; then
    $PY bench/gpu/fsdp_overhead.py --quick --micro-batch 2 --seq-len 64 --steps 1 --windows 1 --warmup 1 \
      --out "$W/fsdp.json"
  else
    $PY bench/gpu/fsdp_overhead.py --presets tinyllama-1.1b --windows 3 --out "$W/fsdp.json"
  fi
}

if [ "${1:-}" = --stage-body ]; then  # one stage, in the environment campaign.sh exported
  name=$2
  case ",${CAMPAIGN_BREAK:-}," in
    *",$name=fail,"*) echo "error: broken on purpose (CAMPAIGN_BREAK)"; exit 3 ;;
    *",$name=hang,"*) echo "hanging on purpose (CAMPAIGN_BREAK)"; sleep 300; exit 0 ;;
  esac
  "stage_${name//[-.]/_}"
  exit $?
fi

# ---- the campaign -------------------------------------------------------------------------------------------
usage() { sed -n '/^#   bash/p' "$0" | sed 's/^#  //'; }
SMOKE=0 CALL=all ONLY="" BRING="" OUT=""
COMMAND="bash bench/gpu/campaign.sh $*"
while [ $# -gt 0 ]; do
  case $1 in
    --smoke) SMOKE=1 ;;
    --call) CALL=${2:-}; shift ;;
    --only) ONLY=${2:-}; shift ;;
    --bring) BRING=${2:-}; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "campaign: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) OUT=$1 ;;
  esac
  shift
done
case $CALL in 1) STAGES=$CALL1 ;; 2) STAGES=$CALL2 ;; all) STAGES="$CALL1 $CALL2" ;;
  *) echo "campaign: --call takes 1 or 2" >&2; exit 2 ;; esac
[ -n "$OUT" ] || { usage >&2; exit 2; }
if [ -n "$ONLY" ]; then
  kept=""
  for entry in $STAGES; do [[ ",$ONLY," == *",${entry%%:*},"* ]] && kept="$kept $entry"; done
  for name in ${ONLY//,/ }; do
    [[ " $STAGES " == *" $name:"* ]] || { echo "campaign: no stage $name in call $CALL" >&2; exit 2; }
  done
  STAGES=$kept
fi
OUT=$(realpath -m "$OUT") || exit 2
[ -n "$BRING" ] && BRING=$(realpath -m "$BRING")
cd "$(dirname "$0")/../.." || exit 2
ROOT=$PWD
if [ "$SMOKE" = 1 ] && [[ "$OUT/" == "$ROOT/bench/results/"* ]]; then
  echo "campaign: smoke numbers are not measurements; write them outside bench/results/" >&2; exit 2
fi
mkdir -p "$OUT/logs" "$OUT/raw" "$OUT/work" || exit 2

export SMOKE OUT PY=${PYTHON:-python3} PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
if [ "$SMOKE" = 1 ]; then
  # the code paths, not speed: the CPU even where a GPU is seen, one thread per process (a busy 2-core CI
  # machine is not thrashed)
  export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1 CARRY="" BUDGET=${CAMPAIGN_BUDGET_S:-100000}
  export DATA=${HOPPERLM_DATA_DIR:-$(cd "$ROOT/.." && pwd)/shared/data}
else
  CARRY=$ROOT/gpu-carry/call$CALL
  [ "$CALL" = all ] && CARRY=$ROOT/gpu-carry/call1
  [ -d "$CARRY" ] || echo "campaign: no $CARRY (bash scripts/gpu_carry.sh --call N, then carry it)" >&2
  wheels=$(ls "$ROOT"/gpu-carry/call*/whl/*.whl 2>/dev/null | awk -F/ '!seen[$NF]++')
  [ "$CALL" != all ] && wheels=$(ls "$CARRY"/whl/*.whl 2>/dev/null)
  if [ -n "$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      $wheels || echo "campaign: could not install the carried wheels" >&2
    export PYTHONPATH=/tmp/site:$PYTHONPATH
  fi
  export CARRY DATA=$CARRY/data HOPPERLM_DATA_DIR=$CARRY/data BUDGET=${CAMPAIGN_BUDGET_S:-550}
  [ "$CALL" = all ] && BUDGET=${CAMPAIGN_BUDGET_S:-1100}
fi
export HOPPERLM_DATA_DIR=${HOPPERLM_DATA_DIR:-$DATA}
campaign() { "$PY" "$ROOT/bench/gpu/campaign.py" "$@"; }
smoke_flag=(); [ "$SMOKE" = 1 ] && smoke_flag=(--smoke)
campaign machine "$OUT" "${smoke_flag[@]}" --call "$CALL" --carry "$CARRY" --command "$COMMAND" \
  || echo "campaign: could not record the machine" >&2

names=""
for entry in $STAGES; do
  name=${entry%%:*} limit=${entry##*:}
  [ "$SMOKE" = 1 ] && limit=$SMOKE_LIMIT
  [[ ",${CAMPAIGN_BREAK:-}," == *",$name=hang,"* ]] && limit=3
  names="$names${names:+,}$name"
  left=$((BUDGET - SECONDS - 10))
  if [ "$left" -lt "$limit" ]; then
    if [ "$left" -lt 30 ]; then
      campaign skip "$name" "$OUT" "${smoke_flag[@]}" --reason "skipped: ${left} s left of the campaign's ${BUDGET} s"
      campaign summary "$OUT" --stages "$names" --call "$CALL" ${BRING:+--bring "$BRING"}
      continue
    fi
    limit=$left
  fi
  export W=$OUT/raw/$name
  rm -rf "$W"; mkdir -p "$W"
  echo "== stage $name (limit $limit s) ..."
  t0=$(date +%s.%N)
  timeout -k 10 "$limit" bash "$ROOT/bench/gpu/campaign.sh" --stage-body "$name" > "$OUT/logs/$name.log" 2>&1
  rc=$?
  seconds=$("$PY" -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$t0" "$(date +%s.%N)")
  campaign finish "$name" "$OUT" --rc "$rc" --seconds "$seconds" --limit "$limit" "${smoke_flag[@]}" \
    --broken "${CAMPAIGN_BREAK:-}"
  if ! "$PY" -c "import json,sys; sys.exit(not json.load(open(sys.argv[1]))['ok'])" "$OUT/$name.json"; then
    tail -n 5 "$OUT/logs/$name.log" | sed 's/^/   | /'
  fi
  campaign summary "$OUT" --stages "$names" --call "$CALL" ${BRING:+--bring "$BRING"}
done
campaign summary "$OUT" --stages "$names" --call "$CALL" ${BRING:+--bring "$BRING"} --print
"$PY" -c "
import json, sys
sys.exit(0 if all(json.load(open(f'{sys.argv[1]}/{n}.json'))['ok'] for n in sys.argv[2].split(',')) else 1)
" "$OUT" "$names"
