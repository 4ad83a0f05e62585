#!/usr/bin/env bash
# One device call on one H200: the GPU tests, kernel tuning (where the CLI has it), batch-1 decode
# latency on the dense shapes and the throughput workload on a few, results under $OUT.
#
#   bash benchmarks/device_suite.sh                       # from the repository root, on the device
#   STEPS="latency throughput" TP_SHAPES="qwen3-8b" bash benchmarks/device_suite.sh
#
# Carry .cache/qwen3-tokenizer for Qwen3's real tokenizer (else shapes.py writes a word-level one)
# and .whl (wheels of xgrammar and jsonschema with their dependencies, for Python 3.12).
#
# Environment (defaults in brackets):
#   STEPS           the steps, in this order ["tests tune latency throughput"]
#   LAT_SHAPES      latency.py's shapes [every dense shape: shapes.py list --dense]
#   LAT_CONTEXTS    prompt lengths ["128 2048 8192"];  LAT_NEW_TOKENS  timed tokens [128]
#   TP_SHAPES       throughput.py's shapes ["qwen3-0.6b llama-3.2-3b qwen3-8b"]
#   SO_SHAPES       structured.py's shapes ["qwen3-0.6b qwen3-8b"] (step "structured")
#   TUNE_SHAPES     shapes to tune [$LAT_SHAPES];  TUNE_ARGS  extra arguments of `tune` []
#   LAT_ARGS, TP_ARGS, TEST_ARGS   extra arguments of latency.py, throughput.py, pytest []
#   SUITE_DEVICE    auto or cpu (a dry run of the scripts without a GPU) [auto]
#   SUITE_BUDGET_S  seconds for the whole suite [540]; a step gets min(its cap, what is left)
#   TESTS_TIMEOUT, TUNE_TIMEOUT, LAT_TIMEOUT, TP_TIMEOUT   each step's cap [330 180 330 240]
#
# Expected on one H200 (estimates from earlier runs' load and run times, not yet measured as a
# suite): tests 3-6 min (19 tests on one GPU, transformers' parity on shapes up to 8B); tune
# ~1-2 min for a first shape's GEMV (Triton compiles every candidate tiling), its table written
# when the shape finishes; then every other op (not yet timed on a GPU; TUNE_ARGS="--ops
# skinny_gemm decode_attention" narrows it), each entry saved as it is found;
# latency 15-40 s a shape (start-up, mostly Triton compiling for the shape's sizes, then 3
# contexts: ~3 s of timing for 0.6B, ~20 s for 14B), 3-4.5 min for the 7 dense shapes;
# throughput 25-55 s a shape (0.6B, 3B, 8B), 1.5-2.5 min. All four: 10-16 min, more than one
# call; within the budget later steps get what is left and their lines say what they skipped.
# For all of it, two calls:
#   STEPS="tune latency" bash benchmarks/device_suite.sh        (5-8.5 min)
#   then, with tuning_configs.tar.gz unpacked into src/nanoserve/kernels/ here (a device's
#   untracked files do not survive to the next call):
#   STEPS="tests throughput" bash benchmarks/device_suite.sh    (4.5-8.5 min)
#
# Files under $OUT (at most 7): suite.log (steps, times, exit codes, GPU), gpu_tests.log,
# tune.log, tuning_configs.tar.gz (the tuned tables, where tune wrote any), latency.jsonl,
# throughput.jsonl (JSON lines only), bench.log (the benchmarks' whole output and tracebacks).
set -uo pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/suite-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

STEPS=${STEPS:-tests tune latency throughput}
LAT_SHAPES=${LAT_SHAPES:-$($PY benchmarks/shapes.py list --dense | tr '\n' ' ')}
LAT_CONTEXTS=${LAT_CONTEXTS:-128 2048 8192}
LAT_NEW_TOKENS=${LAT_NEW_TOKENS:-128}
TP_SHAPES=${TP_SHAPES:-qwen3-0.6b llama-3.2-3b qwen3-8b}
TUNE_SHAPES=${TUNE_SHAPES:-$LAT_SHAPES}
SO_SHAPES=${SO_SHAPES:-qwen3-0.6b qwen3-8b}
SUITE_DEVICE=${SUITE_DEVICE:-auto}
BUDGET=${SUITE_BUDGET_S:-540}
START=$SECONDS

log() { echo "[$(date +%H:%M:%S) +$((SECONDS - START))s] $*" | tee -a "$OUT/suite.log"; }

# step_timeout CAP: seconds the next step may take (its cap, or what is left of the budget).
step_timeout() {
  local left=$((BUDGET - (SECONDS - START)))
  echo $(( $1 < left ? $1 : left ))
}

{
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.max.sm \
    --format=csv 2>&1 || echo "no nvidia-smi"
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'devices', torch.cuda.device_count())" 2>&1
  git log -1 --format='tree at %h %s' 2>/dev/null || true
} >> "$OUT/suite.log"
# Packages the image lacks (xgrammar, jsonschema), as wheels carried in .whl/.
[ -d .whl ] && $PY -m pip install -q --no-index --find-links .whl xgrammar jsonschema \
  >> "$OUT/suite.log" 2>&1
log "steps: $STEPS; budget ${BUDGET}s"
log "latency shapes: $LAT_SHAPES (contexts $LAT_CONTEXTS); throughput shapes: $TP_SHAPES"

run_tests() {
  local t; t=$(step_timeout "${TESTS_TIMEOUT:-330}")
  (( t < 30 )) && { log "tests: skipped, ${t}s left"; return; }
  log "tests: python -m pytest -q tests/gpu -x (timeout ${t}s)"
  timeout -k 10 "$t" $PY -m pytest -q tests/gpu -x -p no:cacheprovider ${TEST_ARGS:-} 2>&1 \
    | tee "$OUT/gpu_tests.log"
  local rc=${PIPESTATUS[0]}
  log "tests: exit $rc (124: timed out); $(tail -1 "$OUT/gpu_tests.log")"
}

run_tune() {
  if ! $PY -m nanoserve.entrypoints.cli tune --help > /dev/null 2>&1; then
    log "tune: no 'tune' command in nanoserve.entrypoints.cli yet; skipped"
    return
  fi
  local t shape dir deadline rc
  t=$(step_timeout "${TUNE_TIMEOUT:-180}")
  (( t < 20 )) && { log "tune: skipped, ${t}s left"; return; }
  deadline=$((SECONDS + t))
  log "tune: $TUNE_SHAPES (timeout ${t}s in all)"
  for shape in $TUNE_SHAPES; do
    local left=$((deadline - SECONDS))
    (( left < 10 )) && { log "tune: $shape skipped, out of time"; continue; }
    dir=/tmp/suite-models/$shape
    $PY benchmarks/shapes.py write "$shape" "$dir" > /dev/null
    echo "== tune $shape" >> "$OUT/tune.log"
    timeout -k 10 "$left" $PY -m nanoserve.entrypoints.cli tune "$dir" ${TUNE_ARGS:-} \
      >> "$OUT/tune.log" 2>&1
    rc=$?
    log "tune: $shape exit $rc (124: timed out)"
  done
  if [ -d src/nanoserve/kernels/configs ]; then
    tar czf "$OUT/tuning_configs.tar.gz" -C src/nanoserve/kernels configs
    log "tune: tables in tuning_configs.tar.gz"
  fi
}

# bench NAME SCRIPT TIMEOUT ARGS...: JSON lines to NAME.jsonl, everything to bench.log.
bench() {
  local name=$1 script=$2 t; shift 2
  t=$(step_timeout "$1"); shift
  (( t < 30 )) && { log "$name: skipped, ${t}s left"; return; }
  log "$name: $script $* (timeout ${t}s)"
  echo "== $name: $script $*" >> "$OUT/bench.log"
  # The script starts no shape it cannot finish before the step's end (by the last one's time);
  # the timeout is the backstop. Its lines are flushed as each (shape, context) ends.
  timeout -k 10 "$t" $PY "benchmarks/$script" --device "$SUITE_DEVICE" \
    --deadline-s $((t - 20 > 0 ? t - 20 : 1)) "$@" 2>> "$OUT/bench.log" \
    | tee -a "$OUT/bench.log" | grep --line-buffered '^{' >> "$OUT/$name.jsonl"
  local rc=${PIPESTATUS[0]}
  log "$name: exit $rc (124: timed out); $(grep -c '"ms_per_token"\|"output_tok_s"' \
    "$OUT/$name.jsonl" 2>/dev/null) results, $(grep -c '"error"\|"skipped"' "$OUT/$name.jsonl" \
    2>/dev/null) errors or skips"
}

# A table of the results so far, into suite.log (and the call's output tail).
summary() {
  $PY - "$OUT/latency.jsonl" "$OUT/throughput.jsonl" "$OUT/structured.jsonl" <<'PYEOF' \
    2>&1 | tee -a "$OUT/suite.log"
import json, os, sys
for path in sys.argv[1:]:
    if not os.path.exists(path):
        continue
    for line in open(path):
        r = json.loads(line)
        if "error" in r or "skipped" in r:
            print(f"{r['bench']:10} {r['shape']:14} {r.get('error') or 'skipped: ' + r['skipped']}")
        elif r["bench"] == "structured":
            print(f"structured {r['shape']:14} json {r['json_tok_s']:.0f} / free {r['free_tok_s']:.0f}"
                  f" tok/s ({r['throughput_ratio']:.2f}); batch 1 {r['json_batch1_ms']:.3f} /"
                  f" {r['free_batch1_ms']:.3f} ms ({r['batch1_ratio']:.2f}); compile p50"
                  f" {r['compile_ms_p50']} p99 {r['compile_ms_p99']} ms")
        elif r["bench"] == "latency":
            print(f"latency    {r['shape']:14} ctx {r['context']:>5}: {r['ms_per_token']:8.3f} ms/token,"
                  f" floor {r['floor_ms']:.3f} ({r['fraction_of_floor'] or 0:.2f} of it)")
        else:
            print(f"throughput {r['shape']:14} {r['output_tok_s']:9.0f} tok/s, floor"
                  f" {r['floor_tok_s']:.0f} ({r['fraction_of_floor']:.2f}), bytes-only floor"
                  f" {r['bytes_floor_tok_s']:.0f}")
PYEOF
}

for step in $STEPS; do
  case $step in
    tests) run_tests ;;
    tune) run_tune ;;
    # word splitting of the lists is intended
    latency) bench latency latency.py "${LAT_TIMEOUT:-330}" --shapes $LAT_SHAPES \
               --contexts $LAT_CONTEXTS --new-tokens "$LAT_NEW_TOKENS" ${LAT_ARGS:-} ;;
    throughput) bench throughput throughput.py "${TP_TIMEOUT:-240}" --shapes $TP_SHAPES \
                  ${TP_ARGS:-} ;;
    structured) bench structured structured.py "${SO_TIMEOUT:-240}" --shapes $SO_SHAPES \
                  ${SO_ARGS:-} ;;
    *) log "unknown step '$step' (tests, tune, latency, throughput, structured)" ;;
  esac
done
summary
log "done in $((SECONDS - START))s"
exit 0
