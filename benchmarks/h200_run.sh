#!/usr/bin/env bash
# One device call: GPU parity tests, batch-1 latency, the throughput workload; logs under $OUT.
# Usage (on the H200, repo root): bash benchmarks/h200_run.sh [parity] [latency] [throughput] [latency8b] [kernels]
set -u
export PYTHONPATH=$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
for step in "$@"; do
  case $step in
    parity) python3 -m pytest tests/gpu -x -q -s -p no:cacheprovider 2>&1 | tee "$OUT/parity.log" ;;
    latency) python3 benchmarks/latency.py --shape qwen3-0.6b 2>&1 | tee "$OUT/latency.log" ;;
    latency8b) python3 benchmarks/latency.py --shape qwen3-8b 2>&1 | tee "$OUT/latency8b.log" ;;
    throughput) python3 benchmarks/throughput.py --hf-max-new 64 2>&1 | tee "$OUT/throughput.log" ;;
    kernels) python3 benchmarks/kernels.py --quick 2>&1 | tee "$OUT/kernels.log" ;;
  esac
done
grep -h '^{' "$OUT"/*.log > "$OUT/results.jsonl" 2>/dev/null
exit 0
