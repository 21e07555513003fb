#!/usr/bin/env bash
# The GPU evidence in one 15-minute lease: two device calls, E (<= 7.5 minutes) then F (<= 4 minutes, sent
# within the 30 s the machine stays warm after E), each a list of stages in order of value, each stage under its
# own time limit (`timeout`) and writing OUT/<stage>.json ({"stage", "ok", "seconds", "key", ...}) the moment it
# ends, so a time-out loses only the stage in flight; then one summary table. Exits 1 if any stage failed.
#
#   bash bench/gpu/campaign.sh [--smoke] [--call E|F|A|B|C|D|R] [--only STAGE,...] [--bring DIR] OUT
#   bash bench/gpu/campaign.sh --plan [--call E|F|A|B|C|D|R]
#
#   call E  (issue 47: the 350M step) each bench row a median of 5 windows with its min and max, beside the
#           plan's own row ("hopperlm") in the same stage; the hopperlm rows train 20 steps on real text first,
#           so their losses compare (the numerics of every lever against today's step)
#           bench-e-step         the plan's step (today's); with fused q/k/v and gate/up GEMMs; Liger's kernels;
#                                Muon (the race's optimizer) at the same shape; micro-batch 32
#           bench-e-attention    SDPA flash and cudnn forced, beside the plan's probe-chosen one;
#                                packed documents (4 a row) under FlexAttention's block mask
#           bench-owt-step        owt-350m's real step (Muon, seq 512, 64 x 8 accumulation) beside AdamW there,
#                                and the race's levers (ReLU², QK-norm, softcap, NorMuon, ...) at equal parameters
#           bench-e-compile      the whole model as one graph (add + norm fused across blocks) and
#                                max-autotune-no-cudagraphs: their warm-up is their compile time
#   call F  (issue 47: QLoRA fast and lean) bench/gpu/qlora.py, Llama-2-7B shape, 10 timed steps a row
#           qlora-fast-lean      hopperlm QLoRA compiled (with a memory snapshot of its warm-up) and uncompiled
#                                beside transformers + peft + bitsandbytes, each twice
#           qlora-fixes          compiled QLoRA with the checkpoint outside the compiled block, then with the
#                                loss region in eager: which one takes the extra memory away
#   call A  bench-h100-350m      hopperlm bench: eager, hopperlm bf16 and float8 (the real training step), HF
#           qlora                bench/gpu/qlora.py: hopperlm QLoRA vs transformers + peft + bitsandbytes, 7B shape
#           owt-350m             20 steps of configs/owt-350m-h100.yaml: finder, one evaluation, one checkpoint
#           gpu-tests            pytest -m gpu (the GPU-only tests), 30 s per test at most
#   call B  lora                 bench/gpu/qlora.py: hopperlm LoRA vs transformers + peft on the same base
#           gpu-tests-qlora      pytest -m gpu tests/test_qlora.py (needs the carried bitsandbytes)
#           flash-ac-finder      forced flash attention + full activation checkpointing + micro-batch finder
#           cudagraphs-accum     CUDA graphs + gradient accumulation: finite losses, or a clean refusal
#   call C  (a later lease)      bench-hf-compile, profile-h100-350m (top-kernels table only),
#                                bench-tinyllama-1.1b, fsdp-overhead
#   call D  (after A, same lease) qlora-compile (QLoRA with train.compile true beside it without),
#                                bench-h100-350m-mb32 (micro-batch 16 beside 32 at seq 1024)
#   call R  (issue 66; a later lease, after E and F, carrying gpu-carry-r/: scripts/gpu_carry.sh --call-r)
#           race-r               bench/gpu/race_r.py: the matrix-proxy race at width 256, hopperlm and the best
#                                baseline of the CPU race at width 128, 2 seeds, hopperlm at 2 shorter budgets
# --plan prints a call's stages, their limits and the sum against the call's budget, and runs nothing.
# Without --call: every call's stages. --smoke: every stage on the CPU at tiny sizes, CPU stand-ins where a
# kernel needs CUDA (labelled so); no carry, no network; CI runs it (tests/test_gpu_campaign.py), and
# scripts/gpu_carry.sh runs it again under the GPU image's torch 2.11 and transformers 5.17. Smoke numbers are
# never measurements: OUT may not be under bench/results/.
# On the GPU machine the carry comes from gpu-carry/ (scripts/gpu_carry.sh). A stage starts only with 30 s of
# the call's budget left (CAMPAIGN_BUDGET_S overrides it) and is cut to what is left. --bring DIR: after every
# stage, DIR gets campaign-callX.tar.gz (all of OUT but work/, checkpoints and traces) and summary-callX.txt,
# two files for the device tool's $OUT. The exact device calls: bench/gpu/README.md.
# Test hook: CAMPAIGN_BREAK="STAGE=fail,STAGE=hang" breaks those stages on purpose.
set -uo pipefail

# stage:limit in seconds, in order of value; each call's limits sum to at most its device call's share of the
# lease (A 420 s of timeout_s 450, B 220 s of timeout_s 240: `--plan` shows the sums). B's from the
# 2026-11-27 H100, where 35 s and 40 s cut the QLoRA tests (37 s) and the flash finder (~45 s) short
CALL_E="bench-e-step:110 bench-e-attention:80 bench-owt-step:120 bench-e-compile:110"
CALL_F="qlora-fast-lean:150 qlora-fixes:70"
CALL_A="bench-h100-350m:90 qlora:170 owt-350m:100 gpu-tests:60"
CALL_B="lora:80 gpu-tests-qlora:50 flash-ac-finder:50 cudagraphs-accum:40"
CALL_C="bench-hf-compile:120 profile-h100-350m:70 bench-tinyllama-1.1b:110 fsdp-overhead:110"
CALL_D="qlora-compile:150 bench-h100-350m-mb32:70"
CALL_R="race-r:540"  # 9 minutes: 8 runs of a 5.3M-parameter model side by side (3,915 steps each)
BUDGET_E=420 BUDGET_F=210 BUDGET_A=400 BUDGET_B=210 BUDGET_C=420 BUDGET_D=210 BUDGET_R=550 # seconds of stages
TIMEOUT_E=450 TIMEOUT_F=240 TIMEOUT_A=450 TIMEOUT_B=240 TIMEOUT_C=480 TIMEOUT_D=240 TIMEOUT_R=570 # timeout_s
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
test_timeout() { [ "$SMOKE" = 1 ] && echo 120 || echo 30; }  # per test (pytest-timeout): one hang costs 30 s

stage_gpu_tests() {
  $PY -m pytest -q -m gpu -p no:cacheprovider --timeout "$(test_timeout)" $(gpu_test_files) \
    -k "not qlora_trains_on_cuda"
}
stage_gpu_tests_qlora() {
  $PY -m pytest -q -m gpu -p no:cacheprovider --timeout "$(test_timeout)" tests/test_qlora.py
}

bench() {  # PRESET ARGS...: one JSON rewritten after every row (a time-out keeps the finished rows)
  local preset=$1; shift
  if [ "$SMOKE" = 1 ]; then set -- "$@" --quick --device cpu --steps 1 --windows 1 --warmup 1; fi
  $PY -m hopperlm bench --presets "$preset" --out "$W/bench.json" "$@"
}
# A: the training step as `train` runs it beside eager, float8 and HF (HF + compile's minutes go to call C)
stage_bench_h100_350m() { bench h100-350m --rows "eager,hopperlm,hopperlm fp8,hf"; }
stage_bench_hf_compile() { bench h100-350m --rows "hopperlm,hf+compile"; }
# D: does a bigger micro-batch lift the step's MFU (42.8% at 16 x 1024 on 2026-11-26)?
stage_bench_h100_350m_mb32() { bench h100-350m --rows "hopperlm,hopperlm mb32" --variant mb32:micro_batch=32; }
stage_bench_tinyllama_1_1b() { bench tinyllama-1.1b --rows "eager,hopperlm,hopperlm fp8,hf"; }

# E: every row a median of 5 windows (bench's default) of 10 steps; the hopperlm rows first train 20 steps on the
# same real text (--loss-steps), so each lever's loss sits beside the plan's
e_bench() {  # ROWS VARIANT...: h100-350m at 16 x 1024 on Gutenberg (32,000 pieces, the preset's vocabulary);
  # the smoke's 2-block stand-in has 8,192: Tiny Shakespeare's bytes there
  local rows=$1 data; shift
  if [ "$SMOKE" = 1 ]; then data=$(shakespeare) || return 1; else data=$(gutenberg) || return 1; fi
  local variants=()
  for v in "$@"; do variants+=(--variant "$v"); done
  local steps=20; [ "$SMOKE" = 1 ] && steps=4
  bench h100-350m --rows "$rows" --loss-steps $steps --data "$data" "${variants[@]}"
}
forced() {  # NAME BACKEND: an attention row forcing BACKEND; on the CPU (smoke) math stands in, labelled
  if [ "$SMOKE" = 1 ]; then echo "$1:attention=math"; else echo "$1:attention=$2"; fi
}
stage_bench_e_step() {
  local mb=32; [ "$SMOKE" = 1 ] && mb=4  # the smoke's stand-in: twice its micro-batch, not 16 times
  e_bench "hopperlm,hopperlm fused,hopperlm liger,hopperlm muon,hopperlm mb32" \
    fused:fused_projections=true liger:kernels=liger mb32:micro_batch=$mb
}
stage_bench_e_attention() {
  # (memory-efficient SDPA left out to make room for the race's levers in bench-owt-step: on Hopper the probe
  # chooses between flash and cuDNN, and efficient was never the faster there)
  e_bench "hopperlm,hopperlm flash,hopperlm cudnn,hopperlm docs" \
    "$(forced flash flash)" "$(forced cudnn cudnn)" docs:documents=4
}
stage_bench_e_compile() {  # compile time is each row's warm-up: max-autotune's is what a run would pay
  e_bench "hopperlm,hopperlm scope-model,hopperlm autotune" scope-model:compile_scope=model \
    autotune:compile_mode=max-autotune-no-cudagraphs
}
stage_bench_owt_step() {  # the race recipe's optimizer step: 262,144 tokens as 64 x 512 x 8 (its finder's choice on
  # an H100, 2026-11-27), Muon with the spectral rule at LR 1.5e-3, beside AdamW at the same shape, and the race's
  # levers priced at equal parameters (issue 62): a ReLU² MLP 1.5x SwiGLU's 2816 wide, QK-norm, a logit softcap,
  # NorMuon, Polar Express and cautious weight decay, all in one row (step time only: their LRs do not matter)
  local shape="seq_len=512,micro_batch=64,grad_accum=8" steps=(--steps 1 --warmup 2) ffn=4224  # 5 windows of 1.4 s
  [ "$SMOKE" = 1 ] && shape="seq_len=64,micro_batch=2,grad_accum=2" ffn=1056  # --quick: SwiGLU 704
  local levers="model.mlp=relu2,model.ffn_dim=$ffn,model.qk_norm=true,model.logit_softcap=15.0,muon.normuon=true"
  levers+=",muon.ns=polar_express,muon.cautious_weight_decay=true"
  bench h100-350m --rows "hopperlm owt-muon,hopperlm owt-adamw,hopperlm owt-levers" "${steps[@]}" \
    --variant "owt-muon:optim.name=muon,muon.lr_adjust=spectral,optim.lr=1.5e-3,$shape" \
    --variant "owt-adamw:$shape" \
    --variant "owt-levers:optim.name=muon,muon.lr_adjust=spectral,optim.lr=1.5e-3,$levers,$shape"
}

stage_cudagraphs_accum() {  # micro-batch 16 x 4 accumulation steps under CUDA graphs (reduce-overhead)
  local data size=(--train.micro_batch 16 --train.batch_tokens $((16 * 256 * 4)) --train.max_steps 20)
  data=$(shakespeare) || return 1
  [ "$SMOKE" = 1 ] && size=($(tiny_train) --train.micro_batch 2 --train.batch_tokens 512 --train.max_steps 4)
  $PY -m hopperlm train shakespeare-char-gpu --data.path "$data" --train.compile_mode reduce-overhead \
    "${size[@]}" --train.target_loss null --train.eval_every 0 --train.eval_windows 4 --train.log_every 2 \
    --checkpoint.every 0 --log.report false --log.tensorboard false --run.out_dir "$W/run"
}
stage_flash_ac_finder() {  # train.micro_batch unset: the finder's trial steps run with the forced kernel and AC
  local data attention=flash size=(--train.max_steps 10)
  data=$(shakespeare) || return 1
  # on a CPU only math can be forced (flash and cudnn are CUDA kernels): the stand-in of the same code path
  [ "$SMOKE" = 1 ] && attention=math size=($(tiny_train) --train.max_steps 4)
  $PY -m hopperlm train shakespeare-char-gpu --data.path "$data" --train.attention $attention \
    --train.activation_checkpointing full --train.micro_batch null "${size[@]}" --train.target_loss null \
    --train.eval_every 0 --train.eval_windows 4 --train.log_every 2 --checkpoint.every 0 \
    --log.report false --log.tensorboard false --run.out_dir "$W/run"
}
stage_owt_350m() {  # the recipe as shipped (batch 262,144 tokens, micro-batch by the finder) but for the
  # budget: 20 steps, one short evaluation and one checkpoint at the end, the report; LR warm-up 5 steps
  # instead of 500 so that the loss moves
  local data size=(--train.max_steps 20 --train.eval_every 20 --train.eval_windows 8 --train.log_every 5)
  data=$(gutenberg) || return 1
  [ "$SMOKE" = 1 ] && size=(--model.preset debug --model.max_seq_len 64 --train.seq_len 64
    --train.batch_tokens 256 --train.max_steps 4 --train.eval_every 4 --train.eval_windows 2 --train.log_every 2)
  $PY -m hopperlm train configs/owt-350m-h100.yaml --data.path "$data" --train.target_loss null \
    --schedule.warmup_steps 5 --checkpoint.every 0 --checkpoint.keep_last 1 --log.tensorboard false "${size[@]}" \
    --run.out_dir "$W/run"
}
stage_profile_h100_350m() {  # the trace stays on the machine (too large to come back): the table is the result
  local data size=(--model.max_seq_len 1024 --train.seq_len 1024 --train.micro_batch 16 --train.batch_tokens 16384)
  data=$(gutenberg) || return 1
  [ "$SMOKE" = 1 ] && size=(--model.preset debug --model.max_seq_len 64 --train.seq_len 64 --train.micro_batch 2
    --train.batch_tokens 128)
  $PY -m hopperlm profile configs/owt-350m-h100.yaml --data.path "$data" "${size[@]}" --steps 3 --wait 1 \
    --warmup 1 --out "$W/profile" --run.out_dir "$W/run"
}
peft_rows() {  # CASES ROW_TIMEOUT [QLORA.PY ARGS...]: bench/gpu/qlora.py's rows on one random Llama-2-7B base
  local cases=$1 row_timeout=$2; shift 2
  if [ "$SMOKE" = 1 ]; then  # 1 repeat unless asked (--repeats below wins), 1 warm-up, 2 timed steps
    $PY bench/gpu/qlora.py --smoke --cases "$cases" --base "$OUT/work/llama2-random" --out "$W/qlora.json" "$@"
  else  # the random 7B checkpoint (13.5 GB bf16) is written to /tmp once per machine: later calls reuse it
    $PY bench/gpu/qlora.py --cases "$cases" --row-timeout "$row_timeout" --out "$W/qlora.json" "$@"
  fi
}
# A, B, D: one run of each row (F repeats them), 10 timed steps (qlora.py's default; 3 before 2026-11-27)
stage_qlora() { peft_rows hopperlm-qlora,hf-qlora 70 --repeats 1; }
stage_lora() { peft_rows hopperlm-lora,hf-lora 40 --repeats 1; }
# D: the plan keeps compile off for QLoRA (1.27x HF on 2026-11-26, target 1.5x; LoRA with compile 2.19x); the
# uncompiled row beside it on the GPU, and only the compiled one in --smoke (A's smoke runs the other); two
# warm-up steps, so that a recompile on the second step is not timed
stage_qlora_compile() {
  if [ "$SMOKE" = 1 ]; then peft_rows hopperlm-qlora-compile 0; return; fi
  peft_rows hopperlm-qlora-compile,hopperlm-qlora 90 --repeats 1 --warmup 2
}
# F: QLoRA fast and lean at once? Compiled (2.13x HF but 11.27 GB on 2026-11-27) and uncompiled hopperlm beside
# transformers + peft + bitsandbytes, each twice (in one process: a second process per case would cost the
# load and compile again, ~80 s more than F has), 10 timed steps each; the compiled row's first repeat records
# the allocator over its warm-up (where do the 4.4 GB go?). The base is written here first (~35 s)
stage_qlora_fast_lean() {  # the baseline first: without it no row of the stage says anything
  peft_rows hf-qlora,hopperlm-qlora-compile,hopperlm-qlora 80 --repeats 2 --same-process --warmup 2 \
    --memory-snapshot hopperlm-qlora-compile
}
# F: one hypothesis per row about the compiled step's extra memory (qlora.py's docstring), once each, in order
# of likelihood (the stage keeps the rows it finishes)
stage_qlora_fixes() {
  peft_rows hopperlm-qlora-compile-eager-ac,hopperlm-qlora-compile-eager-loss 40 --repeats 1 --warmup 2
}
stage_race_r() {  # the race at width 256 (bench/gpu/race_r.py); the CPU race's results file travels in the tree
  if [ "$SMOKE" = 1 ]; then
    $PY bench/gpu/race_r.py --smoke --work "$OUT/work/race-r" --out "$W/race-r.json"
  else
    local results
    results=$(ls bench/results/*-race-matrix-proxy-cpu.json 2>/dev/null | tail -1)
    $PY bench/gpu/race_r.py --books "$CARRY_R/books.tar.xz" --results "$results" --work /tmp/race-r \
      --out "$W/race-r.json"
  fi
}
stage_fsdp_overhead() {
  if [ "$SMOKE" = 1 ]; then
    $PY bench/gpu/fsdp_overhead.py --quick --micro-batch 2 --seq-len 64 --steps 1 --windows 1 --warmup 1 \
      --out "$W/fsdp.json"
  else
    $PY bench/gpu/fsdp_overhead.py --presets tinyllama-1.1b --out "$W/fsdp.json"
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
SMOKE=0 CALL=all ONLY="" BRING="" OUT="" PLAN=0
COMMAND="bash bench/gpu/campaign.sh $*"
while [ $# -gt 0 ]; do
  case $1 in
    --smoke) SMOKE=1 ;;
    --plan) PLAN=1 ;;
    --call) CALL=${2:-}; shift ;;
    --only) ONLY=${2:-}; shift ;;
    --bring) BRING=${2:-}; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "campaign: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) OUT=$1 ;;
  esac
  shift
done
CALL=${CALL^^}
case $CALL in
  E|F|A|B|C|D|R) eval "STAGES=\$CALL_$CALL BUDGET=\$BUDGET_$CALL TIMEOUT=\$TIMEOUT_$CALL" ;;
  ALL) CALL=all STAGES="$CALL_E $CALL_F $CALL_A $CALL_B $CALL_C $CALL_D $CALL_R" TIMEOUT=""
    BUDGET=$((BUDGET_E + BUDGET_F + BUDGET_A + BUDGET_B + BUDGET_C + BUDGET_D + BUDGET_R)) ;;
  *) echo "campaign: --call takes E, F, A, B, C, D or R (got '$CALL'); bench/gpu/README.md says what each holds" >&2; exit 2 ;;
esac
if [ "$PLAN" = 1 ]; then  # what the call runs and that it fits, without running anything
  total=0
  echo "call $CALL: stage limits (seconds), in the order they run"
  for entry in $STAGES; do
    printf '  %-22s %4d\n' "${entry%%:*}" "${entry##*:}"; total=$((total + ${entry##*:}))
  done
  printf '  %-22s %4d  (stages start only while the budget of %d s leaves them 30 s%s)\n' "sum" "$total" \
    "$BUDGET" "${TIMEOUT:+; device call timeout_s $TIMEOUT}"
  exit 0
fi
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
  CARRY=$ROOT/gpu-carry
  [ -d "$CARRY" ] || echo "campaign: no $CARRY (run bash scripts/gpu_carry.sh here, then carry it)" >&2
  wheels=$(ls "$CARRY"/whl/*.whl 2>/dev/null)
  if [ -n "$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      $wheels || echo "campaign: could not install the carried wheels" >&2
    export PYTHONPATH=/tmp/site:$PYTHONPATH
  fi
  CARRY_R=$ROOT/gpu-carry-r  # call R's books (scripts/gpu_carry.sh --call-r)
  export CARRY CARRY_R DATA=$CARRY/data HOPPERLM_DATA_DIR=$CARRY/data BUDGET=${CAMPAIGN_BUDGET_S:-$BUDGET}
fi
export HOPPERLM_DATA_DIR=${HOPPERLM_DATA_DIR:-$DATA}
campaign() { "$PY" "$ROOT/bench/gpu/campaign.py" "$@"; }
smoke_flag=(); [ "$SMOKE" = 1 ] && smoke_flag=(--smoke)
campaign machine "$OUT" "${smoke_flag[@]}" --call "$CALL" --command "$COMMAND" \
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
