#!/usr/bin/env bash
# One command on a machine with one NVIDIA GPU, at most 6 minutes in all (a 10-minute loan leaves room for a rerun),
# with nothing installed there but Python, torch and Lightning: xsa-lm runs from this working tree, the rest comes from
# `make gpu-bundle` (hydra-core, omegaconf, the antlr4 runtime, the Shakespeare corpus tokenized). In this order, each
# step measuring what matters most first:
#   xsa_bf16          XSA's fused output projection in bf16 against fp64 (gradients, output), then its orthogonality
#   bench_gpt2_124m   SA and XSA at context 2048, compiled, paired rounds under auto's SDPA kernel (20 rounds of
#                     interleaved steps: the XSA/SA interval resolves 1%), peak memory against the plan, the same compiled with CUDA graphs
#                     (mode="reduce-overhead"), then each other kernel, then eager
#   bench_paper_0.7b  the same for paper_0.7b under auto: MFU and memory
#   train, resume     trainer=fsdp (FSDP2, bf16, compiled blocks, XSA) for a few steps, then resume=auto continuing it
#   fsdp_fake         FSDP2 as rank 0 of 8 on the GPU under a fake process group, paper_0.7b compiled: peak memory
#                     against the plan and recompiles; then paper_0.7b/1.4b/2.7b at world sizes 8 and 64 in fake
#                     tensors: each rank's memory by kind against the plan (scripts/gpu_check_fsdp.py)
# DIR (the argument, else $OUT, else outputs/gpu_check/<time>) gets summary.json and summary.md (one table), rewritten
# after every measurement, plus check.json, steps.jsonl, measurements.json and check.log (every step's output): a
# check cut short keeps what it measured. Scratch (runs, checkpoints, the compiler cache) goes to $GPU_CHECK_WORK, else
# /tmp/gpu_check_work. Exit code: 0 when every step ran and every check held, 1 otherwise, 2 when it could not start.
#
#   scripts/gpu_check.sh [DIR]                      # or: make gpu-check
#   PYTHON=python3 GPU_CHECK_BUNDLE=build/gpu-bundle scripts/gpu_check.sh DIR   # the defaults
#   GPU_CHECK_ALLOW_CPU=1 scripts/gpu_check.sh DIR  # no GPU: the same steps on CPU with the tiny model (a rehearsal)
#   scripts/gpu_check.sh --plan                     # each mode's steps and time limits, nothing run
#
# Time limits on the GPU, derived from the CPU rehearsal (GPU_CHECK_ALLOW_CPU=1) run with the GPU machine's torch
# (2.11.0+cu130) on this project's 2-core machine: each step's CPU seconds (steps.jsonl, `times` of its processes; one
# torch thread; the tiny model, so nearly all of it is Python, imports and compiling) are taken x1.0 on the GPU
# machine. About half of them is a C++ compiler building kernels one at a time (torch's compile times, in
# measurements.json), which there Triton does on 16 workers; against that stand CUDA's context, cuBLAS and cuDNN plans
# and Triton's autotuning: taken as even. The timed part: FLOPs at 30% MFU of the H200's 989.5 TFLOP/s (gpt2_124m:
# 0.968 GFLOP/token x 16,384 tokens = 53 ms a step; paper_0.7b: 5.45 GFLOP/token, 301 ms), x1.3 for the
# synchronisation after every step (the rounds now interleave SA's and XSA's steps with one synchronisation a round).
#
# | step             | CPU rehearsal, CPU s (measured)   | GPU timed part                                 | limit |
# |------------------|-----------------------------------|------------------------------------------------|------:|
# | start-up         | import check 4, summaries 0.1     | -                                              |  (10) |
# | xsa_bf16         | 35 for one shape, a second +4     | ~0                                             |    30 |
# | bench_gpt2_124m  | 57: start 7, auto's kernel 32,    | auto 20 rounds x 2 x 6 steps x 69 ms = 17;     |    95 |
# |                  | math 16, eager 1: on the GPU 2    | flash and efficient 10 rounds each: 17; eager  |       |
# |                  | further kernels, 7 + 32 + 2 x 16  | 5 rounds: 5; profiled and memory steps: 3      |       |
# |                  | + 1 = 72                          | = 42; 114 in all                               |       |
# | bench_paper_0.7b | 21 with gpt2's compiler cache;    | (2 warm-up + 3 rounds x 3 + 4 probe and        |    65 |
# |                  | cold, as gpt2's first kernel: 39  | memory) x 2 x 0.39 s = 11; 50 in all           |       |
# | train            | 44                                | 20 steps, validation, a 1.1 GB checkpoint: ~8  |    50 |
# | resume           | 21 (compiler cache warm)          | its load, 20 steps, validation, a save: ~8     |    40 |
# | fsdp_fake        | 46: the tiny shard compiled, then | 3 compiled steps of paper_0.7b's shard: ~2     |    70 |
# |                  | paper_0.7b at 8 and 64 in fakes   |                                                |       |
# The CPU column above is from before CUDA graphs and fsdp_fake were added, but for fsdp_fake; with them (torch
# 2.11.0+cu130 on CPU, 2026-12-06, load 11): xsa_bf16 30, bench_gpt2_124m 48 (auto's kernel and CUDA graphs; math
# and bench_paper_0.7b, the same tiny model again, no longer run on CPU), train 49, resume 25, fsdp_fake 46: 198 CPU s.
# With 7 interleaved rounds a phase (2026-12-06, torch 2.11.0+cu130, load 4): xsa_bf16 26, bench_gpt2_124m 53, train
# 39, resume 20, fsdp_fake 36: 174 CPU s, 279 s wall (the rounds: 1.8 s of the bench step).
# Measured on the H200 (results/gpu_check_h200, before CUDA graphs and fsdp_fake were added): xsa_bf16 22 s,
# bench_gpt2_124m 76 (a further kernel: ~5 s compiling, 5-7 s timed), bench_paper_0.7b 51, train 41, resume 32; the
# limits above are those plus what was added (CUDA graphs: as a further kernel, ~15 s) and ~20% (train, resume).
# Every timed phase runs at least 7 rounds (the Hodges-Lehmann interval needs 6). Against the H200's measured timed
# parts (gpt2_124m: 0.49 s a round under auto, 0.52-0.67 s under flash/efficient, eager 0.86 s; paper_0.7b: 1.1 s):
# flash, efficient and CUDA graphs 10 -> 7 rounds (-5 s), eager 5 -> 7 (+2 s), paper_0.7b 3 -> 7 (+4.4 s), so
# bench_gpt2_124m gives 5 s to bench_paper_0.7b: 95 (expected 88) and 65 (expected 56).
# fsdp_fake is not measured on a GPU: its limit is 20 s for paper_0.7b's compile (bench_paper_0.7b's warm-up: 11 s)
# and 6 fake-tensor rows at ~5 s of host time each (CPU: ~8 CPU s each); rows left out by the deadline are listed.
# The limits add up to 350 s: with the start-up, 360 (GPU_CHECK_BUDGET_S). GPU_CHECK_DEADLINE, 5 s before a step's
# limit, ends its optional work first: a bench step measures auto's kernel and the memory, then CUDA graphs and a
# further kernel only while the time left allows 1.1 x what it is expected to take (the last further one's time,
# else 60% of the first's compiling and its rounds), and eager last; fsdp_fake starts a fake row only while the
# time left allows 1.5 x the last one's.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
BUNDLE="${GPU_CHECK_BUNDLE:-$REPO/build/gpu-bundle}"
# The whole check, start-up included (GPU_CHECK_BUDGET_S sets both). The CPU rehearsal gets more: on a shared 2-core
# machine its wall clock varies 2x with the load, and only its running through matters.
GPU_BUDGET_S="${GPU_CHECK_BUDGET_S:-360}"
CPU_BUDGET_S="${GPU_CHECK_BUDGET_S:-600}"
START_UP_S=10          # the import check and the summaries between steps: in the budget, in no step's limit
DEADLINE_MARGIN_S=5    # a step's optional work ends this long before its limit

# The steps, in this order, and each one's limit in seconds: "name:limit" (the table above). GPU_CHECK_STEPS runs a
# subset with other limits, e.g. GPU_CHECK_STEPS="bench_paper_0.7b:300" (resume only with train: it continues it).
# On CPU both bench steps would run the same tiny model through the same code: only the first runs.
GPU_STEPS=(xsa_bf16:30 bench_gpt2_124m:95 bench_paper_0.7b:65 train:50 resume:40 fsdp_fake:70)
CPU_STEPS=(xsa_bf16:70 bench_gpt2_124m:190 train:130 resume:80 fsdp_fake:120)
KNOWN_STEPS=" xsa_bf16 bench_gpt2_124m bench_paper_0.7b train resume fsdp_fake "

fail() {  # one line, exit 2: the check did not start
  echo "gpu_check: error: $*" >&2
  exit 2
}

limits_total() {
  local total=0 step
  for step in "$@"; do total=$((total + ${step##*:})); done
  echo "$total"
}

children_cpu() {  # CPU_S: user + system seconds of every finished child so far (`times`, run in this shell)
  local file="${TMPDIR:-/tmp}/gpu_check_times.$$"
  times >"$file"
  CPU_S=$(tail -n 1 "$file" | awk '{ n = 0; for (i = 1; i <= 2; i++) { split($i, t, /[ms]/); n += 60 * t[1] + t[2] }
    printf "%d\n", n + 0.5 }')
  rm -f "$file"
}

# run_step NAME LIMIT COMMAND...: the command's output appended to check.log, its outcome one line of steps.jsonl,
# then the summary anew. A step gets at most what is left of the budget; with under 10 s left it is skipped. The
# command sees GPU_CHECK_DEADLINE (Unix seconds): when to have finished its optional work.
run_step() {
  local name=$1 limit=$2 rc status
  shift 2
  local left=$((BUDGET_S - (SECONDS - START))) t0=$SECONDS start_byte end_byte cpu0
  start_byte=$(wc -c <"$DIR/check.log")
  children_cpu
  cpu0=$CPU_S
  if [ "$left" -lt 10 ]; then
    rc=124 status=skipped limit=0
    echo "== $name: skipped, the budget (GPU_CHECK_BUDGET_S=$BUDGET_S) is spent" >>"$DIR/check.log"
  else
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (at most $limit s)" | tee -a "$DIR/check.log"
    GPU_CHECK_DEADLINE=$(($(date +%s) + limit - DEADLINE_MARGIN_S)) \
      timeout --kill-after=5 "$limit" "$@" >>"$DIR/check.log" 2>&1
    rc=$?
    if [ $rc = 0 ]; then status=ok; elif [ $rc = 124 ] || [ $rc = 137 ]; then status="timed out"; else status=failed; fi
  fi
  end_byte=$(wc -c <"$DIR/check.log")
  children_cpu
  local cpu=$((CPU_S - cpu0))
  echo "   $status (exit $rc) after $((SECONDS - t0)) s ($cpu CPU s)"
  "$PY" -c 'import json, sys; n, st, rc, s, cpu, lim, a, b = sys.argv[1:]; print(json.dumps({"name": n, "status": st,
"exit_code": int(rc), "seconds": int(s), "cpu_seconds": int(cpu), "limit_s": int(lim), "log_start": int(a),
"log_end": int(b)}))' "$name" "$status" "$rc" "$((SECONDS - t0))" "$cpu" "$limit" "$start_byte" "$end_byte" \
    >>"$DIR/steps.jsonl"
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
  START=$SECONDS
  return 0  # sourced (tests): the functions only
fi

if [ "${1:-}" = --plan ]; then  # one JSON line per mode
  for mode in gpu cpu; do
    declare -n steps="${mode^^}_STEPS" budget="${mode^^}_BUDGET_S"
    printf '{"mode": "%s", "budget_s": %d, "start_up_s": %d, "limits_total_s": %d, "steps": "%s"}\n' \
      "$mode" "$budget" "$START_UP_S" "$(limits_total "${steps[@]}")" "${steps[*]}"
  done
  exit 0
fi

START=$SECONDS  # the budget counts from here: the import check below is part of it
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
for mode in GPU CPU; do
  declare -n steps="${mode}_STEPS" budget="${mode}_BUDGET_S"
  total=$(limits_total "${steps[@]}")
  [ $((total + START_UP_S)) -le "$budget" ] ||
    fail "the ${mode} step limits add up to $total s, over its budget of $budget s less $START_UP_S s of start-up"
done

# Lightning looked up, not imported: its import alone takes seconds
CUDA=$("$PY" -c "import importlib.util as u, hydra, omegaconf, torch; assert u.find_spec('lightning')
print(torch.cuda.is_available())" 2>/dev/null) ||
  fail "$PY cannot import torch, hydra and omegaconf or find lightning (with PYTHONPATH=$PYTHONPATH)"
if [ "$CUDA" = True ]; then
  MODE=gpu STEPS=("${GPU_STEPS[@]}") BUDGET_S=$GPU_BUDGET_S
elif [ "${GPU_CHECK_ALLOW_CPU:-0}" = 1 ]; then
  MODE=cpu STEPS=("${CPU_STEPS[@]}") BUDGET_S=$CPU_BUDGET_S  # a rehearsal: the tiny model, a few steps
else
  fail "no NVIDIA GPU here (torch.cuda.is_available() is false); GPU_CHECK_ALLOW_CPU=1 rehearses on CPU"
fi
TOTAL=$(limits_total "${STEPS[@]}")

start_check "$DIR" "$MODE" "${STEPS[@]}"
WORK="${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/gpu_check_work}"  # kept: a rerun on the same machine finds its compiled code
mkdir -p "$WORK" || fail "cannot create $WORK"
export XSA_LM_DATA_DIR="$WORK/data" TORCHINDUCTOR_CACHE_DIR="$WORK/inductor" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
echo "gpu_check: $MODE, budget $BUDGET_S s (step limits $TOTAL s); results in $DIR, scratch in $WORK"

MEASURE=("$PY" "$REPO/scripts/gpu_check_measure.py" "$DIR")
XSA_LM=("$PY" "$REPO/scripts/gpu_xsa_lm.py")
RUN="$WORK/runs/$(date +%Y%m%d-%H%M%S)-$$"  # this check's own: resume=auto continues its train step, no other
TRAIN=(data=prepared "data.dir=$BUNDLE/shakespeare-bpe" logger=csv progress_bar=false trainer=fsdp trainer.devices=1
       compile=true attention=xsa "hydra.run.dir=$RUN")
if [ "$MODE" = gpu ]; then
  SHAPES=(--shape 12,64,2048 --shape 6,256,2048)
  # 20 rounds: at a round's sd of 0.5% (steps interleaved one by one), the Hodges-Lehmann interval is about +-0.25%
  # wide: it tells 1.00 from 1.01. Every other timed phase: 7 rounds, one more than the interval needs.
  GPT2=(--model gpt2_124m --context 2048 --micro-batch 8 --backends auto,cudnn,flash,efficient
        --rounds 20 --cuda-graph-rounds 7 --other-rounds 7 --steps 6 --warmup 2 --eager-rounds 7)
  BIG=(--model paper_0.7b --context 2048 --micro-batch 8 --backends auto --rounds 7 --steps 3 --warmup 2)
  TRAIN+=(model=gpt2_124m micro_batch_size=8 global_batch_tokens=16384 val_every_steps=20 data.val_windows=32
          data.num_workers=2)
  FSDP=(--device cuda --micro-batch 8 --real paper_0.7b:8)  # the paper sizes at world sizes 8 and 64: the defaults
  FIRST_STEPS=20 RESUMED_STEPS=40
else  # the same code paths with the tiny model; CPU's kernels are flash and math (cudnn and efficient: not run)
  SHAPES=(--device cpu --shape 4,32,128)
  # 2 shared cores: a pool of compile workers costs more than it saves, and two OpenMP threads wait on each other
  # (compiled steps of the tiny model: 27 ms with one thread, 300 ms with two under load)
  export TORCHINDUCTOR_COMPILE_THREADS=1 OMP_NUM_THREADS=1
  TINY=(--device cpu --model tiny --vocab-size 4096 --context 64 --micro-batch 4 --override model.n_layer=2)
  GPT2=("${TINY[@]}" --backends auto,cudnn,flash,efficient --rounds 7 --cuda-graph-rounds 7 --steps 2 --warmup 1
        --eager-rounds 7)
  BIG=("${TINY[@]}" --backends auto --rounds 7 --steps 2 --warmup 1)
  TRAIN+=(model=tiny model.n_layer=2 trainer.accelerator=cpu trainer.precision=32-true micro_batch_size=8
          global_batch_tokens=1024 val_every_steps=4 data.val_windows=4)
  FIRST_STEPS=4 RESUMED_STEPS=8
  # the first paper size in fake tensors (each costs seconds, not memory) and the tiny model's shard compiled, in the
  # train step's shapes (its compiled kernels are found in the compiler's cache)
  FSDP=(--device cpu --micro-batch 8 --models paper_0.7b --real tiny:8 --real-override model.n_layer=2
        --vocab-size 4096 --context 128)
fi

step xsa_bf16 "${MEASURE[@]}" xsa_bf16 "${SHAPES[@]}"
step bench_gpt2_124m "${MEASURE[@]}" bench_gpt2_124m "${GPT2[@]}"
step bench_paper_0.7b "${MEASURE[@]}" bench_paper_0.7b "${BIG[@]}"
for name in train resume; do  # the same run directory: resume=auto continues the train step's run
  [ -n "$(limit_of $name "${STEPS[@]}")" ] || continue
  extra=(trainer.max_steps=$FIRST_STEPS)
  [ $name = resume ] && extra=(resume=auto trainer.max_steps=$RESUMED_STEPS)
  step $name "${XSA_LM[@]}" train "${TRAIN[@]}" "${extra[@]}"
  "$PY" "$REPO/scripts/gpu_check_summary.py" "$DIR" --record-run $name "$RUN" >/dev/null
done
step fsdp_fake "$PY" "$REPO/scripts/gpu_check_fsdp.py" "$DIR" "${FSDP[@]}"

"$PY" "$REPO/scripts/gpu_check_summary.py" "$DIR" --final
