#!/usr/bin/env bash
# One command on a machine with one NVIDIA GPU (under 8 minutes on an H100/H200): the benchmark of gpt2_124m (context
# 2048, bf16, compile) and of paper_0.7b (MFU, peak memory against `xsa-lm plan`), 100 steps of `xsa-lm train` with
# bf16 + compile + FSDP2 on one GPU for SA and XSA, and an eval/generate smoke on their checkpoints. Writes
# summary.json and summary.md (and every step's log) into the directory given as argument, else $OUT, else
# outputs/gpu_check/<time>. A failing step is recorded in the summary and the others still run; the exit code is
# non-zero when any step failed or a check did not hold.
#
#   scripts/gpu_check.sh [DIR]              # or: make gpu-check
#   GPU_CHECK_ALLOW_CPU=1 scripts/gpu_check.sh DIR   # no GPU: the same pipeline on CPU, tiny model (a rehearsal)
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-${OUT:-outputs/gpu_check/$(date +%Y-%m-%d_%H-%M-%S)}}"  # a new directory per check by default
BIN="${XSA_LM_BIN:-$REPO/.venv/bin}"
[ -x "$BIN/xsa-lm" ] || BIN="$(dirname "$(command -v xsa-lm || echo /nonexistent/xsa-lm)")"
PY="$BIN/python"
[ -x "$BIN/xsa-lm" ] || { echo "gpu_check: error: xsa-lm not found (make install, or set XSA_LM_BIN)" >&2; exit 2; }
BUDGET_S="${GPU_CHECK_BUDGET_S:-470}"  # the whole check; each step gets at most what is left of it

has_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 &&
    "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null
}
if has_gpu; then
  MODE=gpu
elif [ "${GPU_CHECK_ALLOW_CPU:-0}" = 1 ]; then
  MODE=cpu  # a rehearsal of the pipeline: tiny model, a few steps, fp32
else
  echo "gpu_check: error: no NVIDIA GPU here (nvidia-smi or torch.cuda.is_available() fails);" \
    "GPU_CHECK_ALLOW_CPU=1 rehearses on CPU" >&2
  exit 2
fi

mkdir -p "$DIR/logs" || { echo "gpu_check: error: cannot create $DIR" >&2; exit 2; }
DIR="$(cd "$DIR" && pwd)"
if [ -e "$DIR/steps.jsonl" ]; then
  echo "gpu_check: error: $DIR holds an earlier check (steps.jsonl): choose another directory" >&2
  exit 2
fi
export XSA_LM_DATA_DIR="${XSA_LM_DATA_DIR:-$DIR/data}" WANDB_MODE=offline PYTHONUNBUFFERED=1
START=$SECONDS

# run_step NAME LIMIT_S COMMAND...: the command's output into logs/NAME.log, its outcome as one line of steps.jsonl.
run_step() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET_S - (SECONDS - START))) t0=$SECONDS rc status
  if [ "$left" -lt 15 ]; then
    rc=124 status=skipped limit=0
    echo "skipped: the check's time budget (GPU_CHECK_BUDGET_S=$BUDGET_S) is spent" >"$DIR/logs/$name.log"
  else
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (at most ${limit} s)"
    timeout --kill-after=10 "$limit" "$@" >"$DIR/logs/$name.log" 2>&1
    rc=$?
    if [ $rc = 0 ]; then status=ok; elif [ $rc = 124 ]; then status="timed out"; else status=failed; fi
  fi
  echo "   $status (exit $rc) after $((SECONDS - t0)) s; log: $DIR/logs/$name.log"
  "$PY" -c 'import json, sys; name, status, rc, s, limit, *cmd = sys.argv[1:]; print(json.dumps({"name": name,
"status": status, "exit_code": int(rc), "seconds": int(s), "limit_s": int(limit), "command": " ".join(cmd),
"log": f"logs/{name}.log"}))' "$name" "$status" "$rc" "$((SECONDS - t0))" "$limit" "$@" >>"$DIR/steps.jsonl"
}

# The eval and generate steps as functions (run by `timeout bash -c`): they need the exported variables below.
eval_smoke() {
  "$PY" "$REPO/scripts/make_shakespeare_cloze.py" --out "$DIR/tasks" --items "$EVAL_ITEMS" &&
    "$BIN/xsa-lm" eval "ckpts=[$DIR/train_sa/checkpoints/last.ckpt,$DIR/train_xsa/checkpoints/last.ckpt]" \
      "tasks=[$DIR/tasks/shakespeare_cloze.yaml]" limit="$EVAL_ITEMS" wandb=false hydra.run.dir="$DIR/eval"
}
generate_smoke() {
  "$BIN/xsa-lm" generate ckpt="$DIR/train_xsa/checkpoints/last.ckpt" prompt=ROMEO: max_new_tokens=48 temperature=0 \
    >"$DIR/generate.txt"
}
export -f eval_smoke generate_smoke
export DIR BIN PY REPO

if [ "$MODE" = gpu ]; then
  GPT2=(model=gpt2_124m vocab_size=50257 context=2048 micro_batch=8 compile=true rounds=3 steps=20 warmup=5)
  BIG=(model=paper_0.7b vocab_size=50257 context=2048 micro_batch=16 compile=true comparisons=[] rounds=2 steps=10
       warmup=5)
  PLAN=(model=paper_0.7b tokenizer=gpt2 trainer=gpu micro_batch_size=16 data.block_size=2048 global_batch_tokens=32768)
  TRAIN=(model=gpt2_124m trainer=fsdp trainer.devices=1 compile=true trainer.max_steps=100 val_every_steps=50
         data.val_windows=64 data.num_workers=2)
  EVAL_ITEMS=100 LIMITS=(200 30 150 120 60 60)
else
  GPT2=(model=tiny smoke=true device=cpu)
  BIG=(model=tiny smoke=true device=cpu comparisons=[])
  PLAN=(model=tiny trainer=cpu micro_batch_size=16)
  TRAIN=(model=tiny model.n_layer=2 trainer=fsdp trainer.accelerator=cpu trainer.devices=1 trainer.precision=32-true
         compile=false trainer.max_steps=10 val_every_steps=5 data.val_windows=16 micro_batch_size=8
         global_batch_tokens=1024)
  EVAL_ITEMS=10 LIMITS=(200 60 200 200 120 60)
fi
COMMON_TRAIN=(data=shakespeare tokenizer=bpe logger=csv progress_bar=false)

run_step bench_gpt2_124m "${LIMITS[0]}" "$BIN/xsa-lm" bench "${GPT2[@]}" out="$DIR/bench_gpt2_124m.json" \
  hydra.run.dir="$DIR/hydra/bench_gpt2_124m"
run_step plan_paper_0.7b "${LIMITS[1]}" "$BIN/xsa-lm" plan "${PLAN[@]}" out="$DIR/plan_paper_0.7b.json"
run_step bench_paper_0.7b "${LIMITS[2]}" "$BIN/xsa-lm" bench "${BIG[@]}" out="$DIR/bench_paper_0.7b.json" \
  hydra.run.dir="$DIR/hydra/bench_paper_0.7b"
for attention in sa xsa; do
  run_step "train_$attention" "${LIMITS[3]}" "$BIN/xsa-lm" train "${TRAIN[@]}" "${COMMON_TRAIN[@]}" \
    attention=$attention hydra.run.dir="$DIR/train_$attention"
done
export EVAL_ITEMS
run_step eval "${LIMITS[4]}" bash -c eval_smoke
run_step generate "${LIMITS[5]}" bash -c generate_smoke

"$PY" "$REPO/scripts/gpu_check_summary.py" "$DIR" --mode "$MODE" --seconds $((SECONDS - START))
