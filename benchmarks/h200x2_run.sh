#!/usr/bin/env bash
# One call on a 2-GPU H200 host. First, side by side: Qwen3-0.6B latency and throughput on GPU 1
# (the single-GPU numbers of #3) and Qwen3-8B at TP=1 on GPU 0. Then, over both GPUs: TP=2
# parity against TP=1, NCCL all-reduce times, and Qwen3-8B at TP=2. Logs under $OUT.
set -u
export PYTHONPATH=$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
{
  CUDA_VISIBLE_DEVICES=1 timeout 100 python3 benchmarks/latency.py --shape qwen3-0.6b
  CUDA_VISIBLE_DEVICES=1 timeout 100 python3 benchmarks/throughput.py --shape qwen3-0.6b
} > "$OUT/single.log" 2>&1 &
{
  CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/latency.py --shape qwen3-8b
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/throughput.py --shape qwen3-8b
} > "$OUT/tp1.log" 2>&1
wait
timeout 240 python3 -m pytest tests/gpu/test_tp_parity.py -q -s -p no:cacheprovider \
  > "$OUT/tp2_parity.log" 2>&1
{
  timeout 60 python3 benchmarks/allreduce.py
  timeout 120 python3 benchmarks/latency.py --shape qwen3-8b --tensor-parallel-size 2
  timeout 150 python3 benchmarks/throughput.py --shape qwen3-8b --tensor-parallel-size 2
} > "$OUT/tp2.log" 2>&1
grep -h '^{' "$OUT"/*.log > "$OUT/results.jsonl" 2>/dev/null
exit 0
