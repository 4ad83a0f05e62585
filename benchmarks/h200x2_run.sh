#!/usr/bin/env bash
# One call on a 2-GPU H200 host, logs under $OUT (at most 8 files come back).
# Side by side first: GPU 0 runs the bf16 parity tests against transformers, then Qwen3-8B at
# TP=1; GPU 1 runs Qwen3-0.6B latency and throughput and the kernel-time profiles. Then over both
# GPUs: TP=2 parity against TP=1 (0.6B and 8B shapes) and Qwen3-8B at TP=2.
set -u
export PYTHONPATH=$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
{
  CUDA_VISIBLE_DEVICES=1 timeout 100 python3 benchmarks/latency.py --shape qwen3-0.6b
  CUDA_VISIBLE_DEVICES=1 timeout 100 python3 benchmarks/throughput.py --shape qwen3-0.6b
  CUDA_VISIBLE_DEVICES=1 timeout 60 python3 benchmarks/profile_step.py --kernels --batch 1
  CUDA_VISIBLE_DEVICES=1 timeout 60 python3 benchmarks/profile_step.py --kernels --batch 256 \
    --new-tokens 64
} > "$OUT/single.log" 2>&1 &
{
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest tests/gpu/test_gpu_parity.py -q -s \
    -p no:cacheprovider
  CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/latency.py --shape qwen3-8b
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/throughput.py --shape qwen3-8b
} > "$OUT/tp1.log" 2>&1
wait
timeout 200 python3 -m pytest tests/gpu/test_tp_parity.py -q -s -p no:cacheprovider \
  > "$OUT/tp2_parity.log" 2>&1
{
  timeout 100 python3 benchmarks/latency.py --shape qwen3-8b --tensor-parallel-size 2
  timeout 120 python3 benchmarks/throughput.py --shape qwen3-8b --tensor-parallel-size 2
} > "$OUT/tp2.log" 2>&1
grep -h '^{' "$OUT"/*.log > "$OUT/results.jsonl" 2>/dev/null
exit 0
