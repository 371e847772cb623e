#!/usr/bin/env bash
# One command on a machine with one NVIDIA GPU, under 7 minutes, with nothing installed there but Python, torch and
# Lightning: xsa-lm runs from this working tree, the rest comes from `make gpu-bundle` (hydra-core, omegaconf, the
# antlr4 runtime, the Shakespeare corpus tokenized). It measures
#   - XSA's orthogonality under bf16 autocast (fused op against xsa_reference),
#   - gpt2_124m and paper_0.7b at context 2048: SA and XSA step time eager and compiled with a 95% interval, tokens/s,
#     MFU, the SDPA kernel that runs, peak memory against xsa_lm.train.memory.estimate (one process per model),
#   - a short FSDP2 bf16 compiled train on one GPU (trainer=fsdp), then resume=auto continuing it.
# DIR (the argument, else $OUT, else outputs/gpu_check/<time>) gets summary.json and summary.md, rewritten after every
# measurement, plus check.json, steps.jsonl, measurements.json and check.log (every step's output): a check cut short
# keeps what it measured. Scratch (runs, checkpoints, compiler caches) goes to $GPU_CHECK_WORK, else a new temp dir.
# Exit code: 0 when every step ran and every check held, 1 otherwise, 2 when the check could not start.
#
#   scripts/gpu_check.sh [DIR]                      # or: make gpu-check
#   PYTHON=python3 GPU_CHECK_BUNDLE=build/gpu-bundle scripts/gpu_check.sh DIR   # the defaults
#   GPU_CHECK_ALLOW_CPU=1 scripts/gpu_check.sh DIR  # no GPU: the same steps on CPU with the tiny model (a rehearsal)
#   scripts/gpu_check.sh --plan                     # each mode's steps and time limits, nothing run
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
BUNDLE="${GPU_CHECK_BUNDLE:-$REPO/build/gpu-bundle}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-400}"  # the whole check; the step limits below add up to less

# The steps, in this order, and each one's limit in seconds: "name:limit". The model steps write as they measure, so
# the slowest (paper_0.7b, compiled last) goes last and keeps whatever it measured before its limit. GPU_CHECK_STEPS
# runs a subset with other limits, e.g. GPU_CHECK_STEPS="bench_paper_0.7b:300" (resume continues what train left).
GPU_STEPS=(xsa_orthogonality:35 bench_gpt2_124m:120 train:90 resume:60 bench_paper_0.7b:90)
CPU_STEPS=(xsa_orthogonality:40 bench_gpt2_124m:120 train:90 resume:60 bench_paper_0.7b:80)
KNOWN_STEPS=" xsa_orthogonality bench_gpt2_124m train resume bench_paper_0.7b "

fail() {  # one line, exit 2: the check did not start
  echo "gpu_check: error: $*" >&2
  exit 2
}

limits_total() {
  local total=0 step
  for step in "$@"; do total=$((total + ${step##*:})); done
  echo "$total"
}

# run_step NAME LIMIT COMMAND...: the command's output appended to check.log, its outcome one line of steps.jsonl,
# then the summary anew. A step gets at most what is left of the budget; with under 10 s left it is skipped.
run_step() {
  local name=$1 limit=$2 rc status
  shift 2
  local left=$((BUDGET_S - (SECONDS - START))) t0=$SECONDS start_byte end_byte
  start_byte=$(wc -c <"$DIR/check.log")
  if [ "$left" -lt 10 ]; then
    rc=124 status=skipped limit=0
    echo "== $name: skipped, the budget (GPU_CHECK_BUDGET_S=$BUDGET_S) is spent" >>"$DIR/check.log"
  else
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (at most $limit s)" | tee -a "$DIR/check.log"
    timeout --kill-after=5 "$limit" "$@" >>"$DIR/check.log" 2>&1
    rc=$?
    if [ $rc = 0 ]; then status=ok; elif [ $rc = 124 ] || [ $rc = 137 ]; then status="timed out"; else status=failed; fi
  fi
  end_byte=$(wc -c <"$DIR/check.log")
  echo "   $status (exit $rc) after $((SECONDS - t0)) s"
  "$PY" -c 'import json, sys; n, st, rc, s, lim, a, b = sys.argv[1:]; print(json.dumps({"name": n, "status": st,
"exit_code": int(rc), "seconds": int(s), "limit_s": int(lim), "log_start": int(a), "log_end": int(b)}))' \
    "$name" "$status" "$rc" "$((SECONDS - t0))" "$limit" "$start_byte" "$end_byte" >>"$DIR/steps.jsonl"
  "$PY" "$REPO/scripts/gpu_check_summary.py" "$DIR" >/dev/null
}

# start_check DIR MODE STEPS...: the directory and its check.json (mode, budget, the steps and their limits).
start_check() {
  DIR=$1 MODE=$2
  shift 2
  mkdir -p "$DIR" || fail "cannot create $DIR"
  DIR="$(cd "$DIR" && pwd)"
  [ -e "$DIR/steps.jsonl" ] && fail "$DIR holds an earlier check (steps.jsonl): choose another directory"
  : >"$DIR/check.log"
  : >"$DIR/steps.jsonl"
  START=$SECONDS
  "$PY" -c 'import json, sys, time; mode, budget, *steps = sys.argv[1:]; print(json.dumps({"mode": mode,
"budget_s": int(budget), "started": time.time(), "steps": {s.split(":")[0]: int(s.split(":")[1]) for s in steps}}))' \
    "$MODE" "$BUDGET_S" "$@" >"$DIR/check.json"
}

limit_of() {  # limit_of NAME STEPS...: the step's limit, nothing when it is not among them
  local name=$1 step
  shift
  for step in "$@"; do [ "${step%%:*}" = "$name" ] && echo "${step##*:}"; done
}

step() {  # step NAME COMMAND...: run_step with the step's limit, when the check includes it
  local name=$1 limit
  shift
  limit=$(limit_of "$name" "${STEPS[@]}")
  [ -z "$limit" ] || run_step "$name" "$limit" "$@"
}

if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
  return 0  # sourced (tests): the functions only
fi

if [ "${1:-}" = --plan ]; then  # one JSON line per mode
  for mode in gpu cpu; do
    declare -n steps="${mode^^}_STEPS"
    printf '{"mode": "%s", "budget_s": %d, "limits_total_s": %d, "steps": "%s"}\n' \
      "$mode" "$BUDGET_S" "$(limits_total "${steps[@]}")" "${steps[*]}"
  done
  exit 0
fi

DIR="${1:-${OUT:-outputs/gpu_check/$(date +%Y-%m-%d_%H-%M-%S)}}"
command -v "$PY" >/dev/null || fail "no Python: set PYTHON"
[ -d "$BUNDLE/site" ] && [ -f "$BUNDLE/shakespeare-bpe/meta.json" ] ||
  fail "no bundle in $BUNDLE: run make gpu-bundle here (or set GPU_CHECK_BUNDLE) and carry it along"
export PYTHONPATH="$BUNDLE/site${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${GPU_CHECK_STEPS:-}" ]; then
  read -r -a GPU_STEPS <<<"$GPU_CHECK_STEPS"
  for s in "${GPU_STEPS[@]}"; do
    [[ "$s" =~ ^[a-z0-9_.]+:[0-9]+$ && "$KNOWN_STEPS" == *" ${s%%:*} "* ]] ||
      fail "GPU_CHECK_STEPS: $s is not name:seconds with a name among$KNOWN_STEPS"
  done
  CPU_STEPS=("${GPU_STEPS[@]}")
fi
for total in "$(limits_total "${GPU_STEPS[@]}")" "$(limits_total "${CPU_STEPS[@]}")"; do
  [ "$total" -lt "$BUDGET_S" ] || fail "the step limits add up to $total s, not below GPU_CHECK_BUDGET_S=$BUDGET_S"
done

CUDA=$("$PY" -c "import hydra, omegaconf, lightning, torch; print(torch.cuda.is_available())" 2>/dev/null) ||
  fail "$PY cannot import torch, lightning, hydra and omegaconf (with PYTHONPATH=$PYTHONPATH)"
if [ "$CUDA" = True ]; then
  MODE=gpu STEPS=("${GPU_STEPS[@]}")
elif [ "${GPU_CHECK_ALLOW_CPU:-0}" = 1 ]; then
  MODE=cpu STEPS=("${CPU_STEPS[@]}")  # a rehearsal: the tiny model, a few steps
else
  fail "no NVIDIA GPU here (torch.cuda.is_available() is false); GPU_CHECK_ALLOW_CPU=1 rehearses on CPU"
fi
TOTAL=$(limits_total "${STEPS[@]}")

start_check "$DIR" "$MODE" "${STEPS[@]}"
WORK="${GPU_CHECK_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}"
mkdir -p "$WORK" || fail "cannot create $WORK"
export XSA_LM_DATA_DIR="$WORK/data" TORCHINDUCTOR_CACHE_DIR="$WORK/inductor" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
echo "gpu_check: $MODE, budget $BUDGET_S s (step limits $TOTAL s); results in $DIR, scratch in $WORK"

MEASURE=("$PY" "$REPO/scripts/gpu_check_measure.py" "$DIR")
XSA_LM=("$PY" "$REPO/scripts/gpu_xsa_lm.py")
RUN="$WORK/train"
TRAIN=(data=prepared "data.dir=$BUNDLE/shakespeare-bpe" logger=csv progress_bar=false trainer=fsdp trainer.devices=1
       compile=true attention=xsa "hydra.run.dir=$RUN")
if [ "$MODE" = gpu ]; then
  SHAPES=(--shape 12,64,2048 --shape 6,256,2048)
  GPT2=(--model gpt2_124m --context 2048 --micro-batch 8 --rounds 4 --steps 5 --warmup 2)
  BIG=(--model paper_0.7b --context 2048 --micro-batch 8 --rounds 3 --steps 3 --warmup 2)
  TRAIN+=(model=gpt2_124m micro_batch_size=8 global_batch_tokens=16384 val_every_steps=15 data.val_windows=32
          data.num_workers=2)
  FIRST_STEPS=30 RESUMED_STEPS=40
else
  SHAPES=(--device cpu --shape 4,32,128 --shape 2,64,128)
  GPT2=(--device cpu --model tiny --vocab-size 4096 --context 128 --micro-batch 8 --rounds 2 --steps 2 --warmup 1)
  BIG=(--device cpu --model tiny --vocab-size 4096 --context 64 --micro-batch 4 --rounds 2 --steps 2 --warmup 1
       --override model.n_layer=2)
  TRAIN+=(model=tiny model.n_layer=2 trainer.accelerator=cpu trainer.precision=32-true micro_batch_size=8
          global_batch_tokens=1024 val_every_steps=5 data.val_windows=4)
  FIRST_STEPS=10 RESUMED_STEPS=15
fi

step xsa_orthogonality "${MEASURE[@]}" xsa_orthogonality "${SHAPES[@]}"
step bench_gpt2_124m "${MEASURE[@]}" bench_gpt2_124m "${GPT2[@]}"
for name in train resume; do  # the same run directory: resume=auto continues the train step's run
  [ -n "$(limit_of $name "${STEPS[@]}")" ] || continue
  extra=(trainer.max_steps=$FIRST_STEPS)
  [ $name = resume ] && extra=(resume=auto trainer.max_steps=$RESUMED_STEPS)
  step $name "${XSA_LM[@]}" train "${TRAIN[@]}" "${extra[@]}"
  "$PY" "$REPO/scripts/gpu_check_summary.py" "$DIR" --record-run $name "$RUN" >/dev/null
done
step bench_paper_0.7b "${MEASURE[@]}" bench_paper_0.7b "${BIG[@]}"

"$PY" "$REPO/scripts/gpu_check_summary.py" "$DIR" --final
