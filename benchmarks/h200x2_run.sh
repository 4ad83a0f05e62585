#!/usr/bin/env bash
# One call on a 2-GPU H200 host: serving on GPU 1 while GPU 0 measures Qwen3-8B at TP=1, then
# NCCL all-reduce times, TP=2 parity against TP=1, and Qwen3-8B at TP=2. Logs under $OUT.
set -u
export PYTHONPATH=$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
(CUDA_VISIBLE_DEVICES=1 bash benchmarks/h200_run.sh serve) &
# At most 8 files come back from $OUT: the TP runs share one log, the parity test first.
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/latency.py --shape qwen3-8b > "$OUT/tp1.log" 2>&1
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/throughput.py --shape qwen3-8b >> "$OUT/tp1.log" 2>&1
wait
{
  timeout 150 python3 -m pytest tests/gpu/test_tp_parity.py -q -s -p no:cacheprovider
  timeout 60 python3 benchmarks/allreduce.py
  timeout 120 python3 benchmarks/latency.py --shape qwen3-8b --tensor-parallel-size 2
  timeout 150 python3 benchmarks/throughput.py --shape qwen3-8b --tensor-parallel-size 2
} > "$OUT/tp2.log" 2>&1
grep -h '^{' "$OUT"/*.log > "$OUT/results.jsonl" 2>/dev/null
exit 0
