#!/usr/bin/env bash
# One device call: GPU parity tests, batch-1 latency, the throughput workload; logs under $OUT.
# Usage (on the H200, repo root): bash benchmarks/h200_run.sh [parity] [latency] [throughput]
#   [throughputonly]
#   [latency8b] [throughputfp8] [latencyfp8] [latency8bfp8] [kernels] [fusedops] [skinny] [skinnysweep] [decodeworkload] [sampling] [profile]
#   [hostprofile] [tputprofile] [serve] [ablatency] [ablatency8b] [abthroughput]
#   [registers] [splittests] [splitab] [splitab8b] [splitsweep] [splitchain] [capsab] [prefetchchain] [smallbatch] [firstrun]
#   [mergetests] [mergechain] [mergelatency] [mergeab] [mergetiles] [readbw] [throughputtwice]
#   [tilesweep] [tileconfirm] [activatetiles] [tiles8b] [gemmpdl] [forwardvariants]
#   [orderindirection] [noattention] [splitrule] [balanceab] [uniformsplits] [cublasltalgos]
#   [samplingab] [samplingwidths] [epiloguechain] [epiloguecheck] [tworows] [tworowtiles]
#   [fourrowtiles] [fourrows] [finalcheck] [tputab] [tput8bprofile] [warpschain] [cudachain]
#   [taggedchain] [layerchain] [vocabchain] [dotprofile] [dotissue] [dotfinal]
#   [samplerflaky] [determinism] [greedyab] [hostwrite] [sessioncheck] [kvlayout] [headmajorab]
#   [headmajorshuffled] [replayorder] [whereitgoes]
#   [replayclocks] [replaygraphs] [replaysweep] [replayrotated]
# The ab steps time an older build and this one back to back on the same machine (machines differ
# by more than most changes): first, here, `git archive REF src benchmarks | tar -x -C abbase`
# (git ignores the folder: name it in the device call's carry), then BASE=abbase on the device.
# Each build runs its own benchmark scripts where the folder has them.
set -u
export PYTHONPATH=$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"

ab() {  # ab LOG SCRIPT ARGS...: SCRIPT under BASE's sources, then this tree's (AB_REVERSE=1: this
  # tree's first); JSON lines labelled
  local log=$1 script=$2 scripts trees; shift 2
  trees=("${BASE:?set BASE to the folder of the older build}" .)
  [ "${AB_REVERSE:-0}" = 1 ] && trees=(. "$BASE")
  for tree in "${trees[@]}"; do
    scripts=$PWD/benchmarks
    [ -d "$tree/benchmarks" ] && scripts=$(cd "$tree/benchmarks" && pwd)
    PYTHONPATH=$tree/src:$scripts python3 "$scripts/$(basename "$script")" "$@" 2>&1 | grep '^{' \
      | sed "s|^{|{\"tree\": \"$tree\", |" | tee -a "$OUT/$log"
  done
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
for step in "$@"; do
  case $step in
    parity) python3 -m pytest tests/gpu -x -q -s -p no:cacheprovider 2>&1 | tee "$OUT/parity.log" ;;
    latency) python3 benchmarks/latency.py --shape qwen3-0.6b 2>&1 | tee "$OUT/latency.log" ;;
    latency8b) python3 benchmarks/latency.py --shape qwen3-8b 2>&1 | tee "$OUT/latency8b.log" ;;
    throughput) python3 benchmarks/throughput.py --hf-max-new 64 2>&1 | tee "$OUT/throughput.log" ;;
    throughputonly) python3 benchmarks/throughput.py 2>&1 | tee "$OUT/throughput.log" ;;
    throughputfp8) python3 benchmarks/throughput.py --kv-cache-dtype fp8 2>&1 | tee "$OUT/throughput_fp8.log" ;;
    latencyfp8) python3 benchmarks/latency.py --shape qwen3-0.6b --kv-cache-dtype fp8 2>&1 | tee "$OUT/latency_fp8.log" ;;
    latency8bfp8) python3 benchmarks/latency.py --shape qwen3-8b --kv-cache-dtype fp8 2>&1 | tee "$OUT/latency8b_fp8.log" ;;
    kernels) python3 benchmarks/kernels.py --quick 2>&1 | tee "$OUT/kernels.log" ;;
    fusedops) python3 benchmarks/fused_ops.py 2>&1 | tee "$OUT/fused_ops.log" ;;
    skinny) python3 benchmarks/skinny_gemm.py 2>&1 | tee "$OUT/skinny.log" ;;
    skinnysweep) python3 benchmarks/skinny_gemm.py --sweep --rows 1 2>&1 | tee "$OUT/skinny_sweep.log" ;;
    readbw) python3 benchmarks/read_bandwidth.py 2>&1 | tee "$OUT/read_bandwidth.log" ;;
    throughputtwice) python3 benchmarks/throughput.py --budgets 16384 16384 2>&1 | tee "$OUT/throughput.log" ;;
    sampling) python3 benchmarks/sampling.py 2>&1 | tee "$OUT/sampling.log" ;;
    decodeworkload) python3 benchmarks/decode_workload.py 2>&1 | tee "$OUT/decode_workload.log" ;;
    tputprofile) python3 benchmarks/throughput.py --profile-kernels 2>"$OUT/throughput_profile.txt" \
                   | tee "$OUT/throughput_profile.log" ;;
    hostprofile) python3 benchmarks/profile_step.py --batch 1 --new-tokens 256 --top 45 \
                   > "$OUT/host_profile.txt" 2>&1 ;;
    profile) python3 benchmarks/profile_step.py --kernels --batch 1 > "$OUT/profile.txt" 2>&1
             python3 benchmarks/profile_step.py --kernels --batch 256 --new-tokens 64 \
               >> "$OUT/profile.txt" 2>&1 ;;
    serve)  # needs the server's wheels: carry .whl (see docs/benchmarks.md)
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
      python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from common import make_model_dir; from pathlib import Path; make_model_dir('qwen3-0.6b', Path('/tmp/serve-model'))"
      PYTHONPATH=$PYTHONPATH:/tmp/site python3 -m nanoserve.entrypoints.cli serve /tmp/serve-model \
        --load-format dummy --port 8011 > "$OUT/server.log" 2>&1 &
      server=$!
      for _ in $(seq 240); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8011/health')" 2>/dev/null && break; sleep 0.5; done
      PYTHONPATH=$PYTHONPATH:/tmp/site python3 benchmarks/serve.py --base-url http://127.0.0.1:8011 \
        --num-prompts 40 --request-rate 1 --random-input-len 256 --random-output-len 128 2>&1 | tee "$OUT/serve.log"
      PYTHONPATH=$PYTHONPATH:/tmp/site python3 benchmarks/serve.py --base-url http://127.0.0.1:8011 \
        --num-prompts 256 --max-concurrency 64 --random-input-len 256 --random-output-len 128 2>&1 | tee -a "$OUT/serve.log"
      kill -INT $server; wait $server ;;
    registers)  # the split kernel as batch-1 decode compiles it, first K/V tile before the wait or not
      for pf in "" --prefetch-kv; do
        python3 benchmarks/kernel_registers.py --new-tokens --wide-offsets --splits 32 --block-n 64 \
          --warps 4 $pf 2>&1 | tee -a "$OUT/registers.log"
      done ;;
    splittests) python3 -m pytest tests/gpu/test_fused_kernels.py tests/gpu/test_gpu_parity.py -q -s \
                  -p no:cacheprovider -k "split_decode or one_sequence" 2>&1 | tee "$OUT/split_tests.log" ;;
    splitab)  # one tree, split decode's K/V prefetch on (the default) and off, interleaved
      for args in "" "--variant prefetch_kv=0" "" "--variant prefetch_kv=0"; do
        python3 benchmarks/latency.py --shape qwen3-0.6b $args 2>&1 | tee -a "$OUT/split_ab.log"
      done ;;
    splitab8b)
      for args in "" "--variant prefetch_kv=0"; do
        python3 benchmarks/latency.py --shape qwen3-8b $args 2>&1 | tee -a "$OUT/split_ab.log"
      done ;;
    splitsweep)  # batch-1 split counts, and the chain with attention left out (a profile)
      for args in "--variant splits=4" "--variant splits=8" "--variant splits=16" "--variant none"; do
        python3 benchmarks/latency.py --shape qwen3-0.6b $args 2>&1 | tee -a "$OUT/split_sweep.log"
      done
      python3 benchmarks/latency.py --shape qwen3-8b --variant none 2>&1 | tee -a "$OUT/split_sweep.log" ;;
    splitchain)  # batch-1 forward per split-decode variant and context (split_decode_chain.py)
      for shape in qwen3-0.6b qwen3-8b; do
        python3 benchmarks/split_decode_chain.py --shape $shape --contexts 136 384 1024 4096 \
          --variants default none splits=4 splits=8 splits=16 num_stages=1 splits=8,num_stages=1 \
          prefetch_kv=0 splits=8,prefetch_kv=0 num_warps=2 splits=8,num_warps=2 unsplit=1 \
          unsplit=1,block_n=128 unsplit=1,num_stages=4 unsplit=1,block_n=32 \
          splits=16,block_n=32 default 2>&1 | tee -a "$OUT/split_chain.log"
      done ;;
    capsab)  # one tree: context caps + one-tile tuning (default) against the build before them
      for shape in qwen3-0.6b qwen3-8b; do
        for args in "" "--variant caps=0,num_stages=3,prefetch_kv=0" "" \
                    "--variant caps=0,num_stages=3,prefetch_kv=0"; do
          python3 benchmarks/latency.py --shape $shape $args 2>&1 | tee -a "$OUT/caps_ab.log"
        done
      done
      for shape in qwen3-0.6b qwen3-8b; do
        python3 benchmarks/split_decode_chain.py --shape $shape \
          --contexts 136 384 511 600 1024 2040 2100 4096 \
          --variants default caps=0,num_stages=3,prefetch_kv=0 caps=0,num_stages=3 \
          splits=16,num_stages=1 splits=8,num_stages=1 caps=0,num_stages=1 none default \
          2>&1 | tee -a "$OUT/caps_chain.log"
      done ;;
    prefetchchain)  # the first K/V tile before the wait, on and off, in the context-capped graphs
      for shape in qwen3-0.6b qwen3-8b; do
        python3 benchmarks/split_decode_chain.py --shape $shape --contexts 136 384 1024 2100 4096 \
          --variants default prefetch_kv=0 default prefetch_kv=0 2>&1 | tee -a "$OUT/prefetch_chain.log"
      done ;;
    smallbatch)  # batches of 2-8 in the context-capped graphs against the build before them
      for shape in qwen3-0.6b qwen3-8b; do
        for batch in 2 4 8; do
          python3 benchmarks/split_decode_chain.py --shape $shape --batch $batch \
            --contexts 136 384 1024 2100 --variants default caps=0,num_stages=3,prefetch_kv=0 \
            default caps=0,num_stages=3,prefetch_kv=0 2>&1 | tee -a "$OUT/small_batch.log"
        done
      done ;;
    mergetests) python3 -m pytest tests/gpu/test_fused_kernels.py tests/gpu/test_gpu_parity.py -q -s \
                  -p no:cacheprovider -k "not fp8 and not logprobs" 2>&1 | tee "$OUT/merge_tests.log" ;;
    mergechain)  # batch-1 o_proj merging the splits (default) against the reduce kernel (merge=0)
      python3 benchmarks/split_decode_chain.py --shape qwen3-0.6b --contexts 136 384 511 1024 \
        --variants default merge=0 default merge=0 2>&1 | tee -a "$OUT/merge_chain.log"
      python3 benchmarks/split_decode_chain.py --shape qwen3-8b --contexts 136 384 \
        --variants default merge=0 merge_tiles=16/8/4 merge_tiles=8/16/8 default merge=0 \
        2>&1 | tee -a "$OUT/merge_chain.log" ;;
    mergeab)  # against the build before (BASE): batch-1 and batch-4 chains, then ms/token
      ab merge_ab_chain.log benchmarks/split_decode_chain.py --shape qwen3-0.6b \
        --contexts 136 384 1024 2100
      ab merge_ab_chain.log benchmarks/split_decode_chain.py --shape qwen3-0.6b --batch 4 \
        --contexts 136 1024 2100
      python3 benchmarks/split_decode_chain.py --shape qwen3-0.6b --contexts 136 384 1024 \
        --variants merge=0 default 2>&1 | grep '^{' | tee -a "$OUT/merge_chain.log"
      ab merge_ab_chain.log benchmarks/split_decode_chain.py --shape qwen3-8b --contexts 136 384
      python3 benchmarks/split_decode_chain.py --shape qwen3-8b --contexts 136 384 \
        --variants merge=0 merge_tiles=16/8/4 merge_tiles=16/16/8 merge_tiles=32/8/8 default \
        2>&1 | grep '^{' | tee -a "$OUT/merge_chain.log"
      ab merge_ab_latency.log benchmarks/latency.py --shape qwen3-0.6b
      ab merge_ab_latency.log benchmarks/latency.py --shape qwen3-8b ;;
    mergetiles)  # the merging o_proj's tiles at both shapes, then 8B ms/token with the best
      python3 -m pytest tests/gpu/test_fused_kernels.py -q -p no:cacheprovider -k "fp8 or merging" \
        2>&1 | tee "$OUT/merge_tiles_tests.log"
      python3 benchmarks/split_decode_chain.py --shape qwen3-0.6b --contexts 136 384 \
        --variants merge=0 merge_tiles=16/16/8 merge_tiles=8/16/8 merge_tiles=8/16/4 merge=0 \
        merge_tiles=16/16/8 2>&1 | grep '^{' | tee -a "$OUT/merge_tiles.log"
      python3 benchmarks/split_decode_chain.py --shape qwen3-8b --contexts 136 384 \
        --variants merge=0 merge_tiles=16/16/8 merge_tiles=16/16/4 merge=0 merge_tiles=16/16/8 \
        2>&1 | grep '^{' | tee -a "$OUT/merge_tiles.log"
      for variant in merge_tiles=16/16/8 merge=0; do
        python3 benchmarks/latency.py --shape qwen3-8b --variant $variant 2>&1 | grep '^{' \
          | tee -a "$OUT/merge_tiles_latency.log"
      done ;;
    mergelatency)  # the same, ms/token, processes interleaved
      for shape in qwen3-0.6b qwen3-8b; do
        for variant in default merge=0 default merge=0; do
          python3 benchmarks/latency.py --shape $shape --variant $variant 2>&1 | grep '^{' \
            | tee -a "$OUT/merge_latency.log"
        done
      done ;;
    tilesweep)  # batch-1 GEMV and merging o_proj tiles in the model's forward, W evict-first
      python3 benchmarks/split_decode_chain.py --shape qwen3-8b --contexts 384 --variants \
        default tile=24576:4096:2:4096 default tile=24576:4096:2:4096 \
        tile=24576:4096:8:4096 tile=24576:4096:4:4096:w8 tile=24576:4096:8:4096:w8 \
        tile=24576:4096:4:2048 tile=24576:4096:8:2048 tile=24576:4096:16:1024 \
        tile=4096:12288:4:4096:w8 tile=4096:12288:8:4096 tile=4096:12288:8:4096:w8 \
        tile=4096:12288:8:2048 tile=4096:12288:4:2048:defer \
        tile=6144:4096:4:4096 tile=6144:4096:2:4096 tile=6144:4096:4:2048 \
        tile=6144:4096:8:2048 tile=6144:4096:8:1024:defer \
        merge_tiles=16/16/4 merge_tiles=8/16/8 merge_tiles=32/16/8 merge_tiles=8/8/4 default \
        2>&1 | grep '^{' | tee -a "$OUT/tile_sweep.log"
      python3 benchmarks/split_decode_chain.py --shape qwen3-0.6b --contexts 384 --variants \
        default tile=4096:1024:4:1024 tile=4096:1024:16:1024 tile=4096:1024:8:1024:w8 \
        tile=6144:1024:8:1024 tile=6144:1024:32:1024 tile=6144:1024:16:1024:w8 \
        tile=6144:1024:32:1024:w8 tile=1024:3072:4:1024:defer tile=1024:3072:2:4096 \
        tile=1024:3072:4:2048:defer tile=1024:3072:1:4096 merge_tiles=8/16/4 \
        merge_tiles=4/16/4 merge_tiles=16/16/8 merge_tiles=8/8/4 default \
        2>&1 | grep '^{' | tee -a "$OUT/tile_sweep.log" ;;
    tileconfirm)  # run 142's winners and their neighbours, then ms/token against the old tiles
      s06="tile=6144:1024:8:1024,tile=1024:3072:4:2048:defer"
      python3 benchmarks/split_decode_chain.py --shape qwen3-0.6b --contexts 136 384 --variants \
        default $s06 default $s06 tile=6144:1024:4:1024 tile=6144:1024:8:1024:w2 \
        tile=1024:3072:8:2048:defer tile=1024:3072:4:2048 tile=1024:3072:2:2048 \
        tile=1024:3072:8:1024:defer tile=1024:3072:4:4096 $s06,tile=4096:1024:16:1024 \
        $s06,merge_tiles=16/16/4 $s06,merge_tiles=4/16/8 $s06 default \
        2>&1 | grep '^{' | tee -a "$OUT/tile_confirm.log"
      s8="tile=6144:4096:4:2048,tile=4096:12288:8:2048"
      python3 benchmarks/split_decode_chain.py --shape qwen3-8b --contexts 384 --variants \
        default tile=6144:4096:4:2048 default tile=6144:4096:4:2048 tile=6144:4096:4:2048:defer \
        tile=6144:4096:2:2048 tile=6144:4096:8:2048:defer tile=4096:12288:8:2048 \
        tile=4096:12288:16:2048 tile=4096:12288:16:1024 tile=4096:12288:8:1024:defer \
        tile=4096:12288:4:2048 $s8 default $s8 \
        2>&1 | grep '^{' | tee -a "$OUT/tile_confirm.log"
      for args in "" "--skinny 6144:1024:8:1024 --skinny 1024:3072:4:2048:defer" "" \
                  "--skinny 6144:1024:8:1024 --skinny 1024:3072:4:2048:defer"; do
        python3 benchmarks/latency.py --shape qwen3-0.6b $args 2>&1 | grep '^{' \
          | tee -a "$OUT/tile_confirm_latency.log"
      done
      for args in "" "--skinny 6144:4096:4:2048 --skinny 4096:12288:8:2048" \
                  "--skinny 6144:4096:4:2048"; do
        python3 benchmarks/latency.py --shape qwen3-8b $args 2>&1 | grep '^{' \
          | tee -a "$OUT/tile_confirm_latency.log"
      done ;;
    activatetiles)  # run 144's tile winners (the default) against the tiles before them
      python3 benchmarks/split_decode_chain.py --shape qwen3-0.6b --contexts 136 384 --variants \
        default tile=1024:3072:4:2048:defer default tile=1024:3072:4:2048:defer \
        2>&1 | grep '^{' | tee -a "$OUT/activate_tiles.log"
      python3 benchmarks/split_decode_chain.py --shape qwen3-8b --contexts 384 --variants \
        default tile=24576:4096:4:4096 default tile=24576:4096:4:4096 \
        2>&1 | grep '^{' | tee -a "$OUT/activate_tiles.log" ;;
    tiles8b)  # 8B's tiles with gate/up writing the activation (run 145 and 144 disagreed on gate/up)
      python3 benchmarks/split_decode_chain.py --shape qwen3-8b --contexts 384 --variants \
        default tile=24576:4096:8:4096 default tile=24576:4096:8:4096 tile=24576:4096:4:2048 \
        tile=24576:4096:2:4096 tile=4096:12288:8:4096 tile=4096:12288:2:4096 \
        tile=4096:12288:4:2048:defer tile=6144:4096:4:4096 default \
        2>&1 | grep '^{' | tee -a "$OUT/tiles_8b.log" ;;
    gemmpdl)  # programmatic edges into cuBLAS's GEMMs in a CUDA graph: safe? worth it? (run 148)
      python3 benchmarks/graph_pdl.py 2>&1 | tee "$OUT/graph_pdl.log" ;;
    forwardvariants)  # decode forwards over the workload replay: K/V load hints (NANOSERVE_KV_LOAD
      # is read by commit 84dbbbb's engine only), cuBLASLt (run 151)
      bash benchmarks/env_variants.sh forward_variants.jsonl NANOSERVE_KV_LOAD=/ \
        NANOSERVE_KV_LOAD=/evict_first NANOSERVE_KV_LOAD=.cg/ NANOSERVE_KV_LOAD=.cg/evict_first \
        TORCH_BLAS_PREFER_CUBLASLT=1 NANOSERVE_KV_LOAD=/ \
        -- benchmarks/stream_split_decode.py --parts ;;
    orderindirection)  # what the seq_order load costs unsplit decode: rows presorted (run 152;
      # NANOSERVE_DECODE_UNORDERED is read by commit ad68449's engine only)
      bash benchmarks/env_variants.sh order_indirection.jsonl NANOSERVE_DECODE_UNORDERED=0 \
        NANOSERVE_DECODE_UNORDERED=1 NANOSERVE_DECODE_UNORDERED=0 NANOSERVE_DECODE_UNORDERED=1 \
        -- benchmarks/stream_split_decode.py --parts --presorted ;;
    noattention)  # decode forwards over the workload replay with and without attention (run 153;
      # NANOSERVE_SKIP_DECODE_ATTENTION is read by commit 6dd0a64's engine only)
      bash benchmarks/env_variants.sh no_attention.jsonl NANOSERVE_SKIP_DECODE_ATTENTION=0 \
        NANOSERVE_SKIP_DECODE_ATTENTION=1 NANOSERVE_SKIP_DECODE_ATTENTION=0 \
        NANOSERVE_SKIP_DECODE_ATTENTION=1 -- benchmarks/stream_split_decode.py --parts ;;
    splitrule)  # the split rule at moderate batches, decode forwards over the replay (run 154;
      # NANOSERVE_SPLIT_TARGET and NANOSERVE_FUSED_MAX_SEQS are read by commit 1e790c1 only)
      bash benchmarks/env_variants.sh split_rule.jsonl NANOSERVE_FUSED_MAX_SEQS=1000000 \
        NANOSERVE_FUSED_MAX_SEQS=8 "NANOSERVE_SPLIT_TARGET=7.5 NANOSERVE_FUSED_MAX_SEQS=8" \
        "NANOSERVE_SPLIT_TARGET=10 NANOSERVE_FUSED_MAX_SEQS=8" \
        "NANOSERVE_SPLIT_TARGET=15 NANOSERVE_FUSED_MAX_SEQS=8" NANOSERVE_FUSED_MAX_SEQS=1000000 \
        -- benchmarks/stream_split_decode.py --parts ;;
    balanceab)  # splits that even out ragged contexts at 16-112 rows, A/B (run 155;
      # NANOSERVE_SPLIT_RULE=old is read by commit 0414054's engine only)
      bash benchmarks/env_variants.sh balance_forwards.jsonl NANOSERVE_SPLIT_RULE=new \
        NANOSERVE_SPLIT_RULE=old -- benchmarks/stream_split_decode.py --parts
      bash benchmarks/env_variants.sh balance_throughput.jsonl NANOSERVE_SPLIT_RULE=new \
        NANOSERVE_SPLIT_RULE=old -- benchmarks/throughput.py
      python3 -m pytest tests/gpu/test_gpu_parity.py -q -s -p no:cacheprovider -k larger_batch \
        2>&1 | tail -3 | tee "$OUT/balance_tests.log"
      bash benchmarks/env_variants.sh balance_throughput.jsonl NANOSERVE_SPLIT_RULE=new \
        NANOSERVE_SPLIT_RULE=old -- benchmarks/throughput.py ;;
    uniformsplits)  # the balance rule's split count against unsplit on uniform contexts
      python3 benchmarks/kernels.py --kernels decode --batches 16 32 64 96 112 \
        --decode-splits 1 2>&1 | grep '^{' | tee "$OUT/uniform_splits.jsonl" ;;
    cublasltalgos) python3 benchmarks/cublaslt_algos.py 2>&1 | tee "$OUT/cublaslt_algos.log" ;;
    firstrun) python3 benchmarks/throughput.py --budgets 16384 16384 16384 2>&1 | tee "$OUT/first_run.log" ;;
    ablatency) ab ab_latency.log benchmarks/latency.py --shape qwen3-0.6b ;;
    ablatency8b) ab ab_latency8b.log benchmarks/latency.py --shape qwen3-8b ;;
    abthroughput) ab ab_throughput.log benchmarks/throughput.py ;;
    samplingab) ab sampling_ab.log benchmarks/sampling.py ;;
    samplingwidths) ab sampling_widths.log benchmarks/sampling.py --widths 2 4 8 16 ;;
    epiloguechain)  # decode forwards with and without the residual epilogue, per batch (runs 180, 184)
      for b in 2 3 4 5 6 7 8 32 64 128 200 256; do
        python3 benchmarks/split_decode_chain.py --batch $b --contexts 512 1536 --replays 200 \
          --variants default epilogue=0 epilogue_min=2 2>&1 | grep '^{' | tee -a "$OUT/epilogue_chain.log"
      done ;;
    tworows)  # batch 2 through the skinny GEMVs (Qwen3-0.6B's shapes): tests, chain, latency, BASE
      python3 -m pytest tests/gpu/test_gpu_parity.py tests/gpu/test_fused_kernels.py -q -s \
        -p no:cacheprovider -k "small_batches or one_sequence or norm_in_gemv or skinny" 2>&1 \
        | grep -E "identical|passed|failed|FAILED|Error" | tee "$OUT/tworows_tests.log"
      python3 benchmarks/split_decode_chain.py --batch 2 --contexts 512 1536 --replays 200 \
        --variants default few_rows=0 2>&1 | grep '^{' | tee -a "$OUT/tworows_chain.log"
      python3 benchmarks/latency.py --shape qwen3-0.6b 2>&1 | tee "$OUT/latency.log"
      ab ab_throughput.log benchmarks/throughput.py --budgets 16384 16384 ;;
    tworowtiles)  # two-row skinny tiles: Qwen3-8B's shapes (one-row tiles lost), Qwen3-0.6B's
      t8() { echo "tile2=6144:4096:$1,tile2=4096:4096:$2,tile2=24576:4096:$3,tile2=4096:12288:$4"; }
      python3 benchmarks/split_decode_chain.py --shape qwen3-8b --batch 2 --contexts 512 \
        --replays 100 --variants default "$(t8 4:2048 4:4096 4:4096 4:4096)" \
        "$(t8 4:1024 4:2048 4:2048 4:2048)" "$(t8 4:1024 4:1024 4:1024 4:1024)" \
        "$(t8 4:2048:w8 4:4096:w8 4:4096:w8 4:4096:w8)" "$(t8 2:2048 2:4096 2:4096 2:4096)" \
        2>&1 | grep '^{' | tee -a "$OUT/tworowtiles.log"
      t6() { echo "tile2=4096:1024:$1,tile2=1024:2048:$2,tile2=6144:1024:$3,tile2=1024:3072:$4"; }
      python3 benchmarks/split_decode_chain.py --batch 2 --contexts 512 --replays 200 \
        --variants default "$(t6 16:512 4:1024:defer 8:512 2:1024:defer)" \
        "$(t6 16:1024:w8 4:2048:defer:w8 8:1024:w8 2:2048:defer:w8)" \
        "$(t6 8:1024 2:2048:defer 4:1024 2:2048)" 2>&1 | grep '^{' | tee -a "$OUT/tworowtiles.log" ;;
    fourrowtiles)  # 4 rows (the engine runs batches of 3 and 4 in that graph) through the skinny
      # GEMVs, 0.6B tiles; the chain captures exactly --batch rows, so batch 3 would not take them
      t4() { echo "tile4=4096:1024:$1,tile4=1024:2048:$2,tile4=6144:1024:$3,tile4=1024:3072:$4"; }
      python3 benchmarks/split_decode_chain.py --batch 4 --contexts 512 1536 --replays 200 \
        --variants default "$(t4 8:1024 2:2048:defer 4:1024 2:2048)" \
        "$(t4 4:1024 2:1024:defer 2:1024 2:1024)" "$(t4 4:512 2:1024:defer 2:512 2:1024)" \
        "$(t4 2:1024 1:2048 2:1024 1:2048)" "$(t4 4:1024:w8 2:2048:defer:w8 2:1024:w8 2:2048:w8)" \
        2>&1 | grep '^{' | tee -a "$OUT/fourrowtiles.log" ;;
    fourrows)  # the 4-row tiles (run 192's winner) in the engine: parity at 4 a time, kernels
      python3 -m pytest tests/gpu/test_gpu_parity.py tests/gpu/test_fused_kernels.py -q -s \
        -p no:cacheprovider -k "small_batches or skinny or few_rows" 2>&1 \
        | grep -E "identical|passed|failed|FAILED|Error" | tee "$OUT/fourrows_tests.log" ;;
    finalcheck)  # a session's final tree: all GPU tests, then one throughput pair against BASE
      python3 -m pytest tests/gpu -q -s -p no:cacheprovider 2>&1 \
        | grep -E "identical|passed|failed|FAILED|Error" | tee "$OUT/final_gpu_tests.log"
      ab ab_throughput.log benchmarks/throughput.py --budgets 16384 16384 ;;
    tputab) ab ab_throughput.log benchmarks/throughput.py --budgets 16384 16384 ;;
    tput8bprofile)  # Qwen3-8B on the throughput workload: a plain run, then one under torch.profiler
      python3 benchmarks/throughput.py --shape qwen3-8b 2>&1 | tee "$OUT/throughput8b.log"
      python3 benchmarks/throughput.py --shape qwen3-8b --profile-kernels \
        2>"$OUT/throughput8b_profile.txt" | tee "$OUT/throughput8b_profile.log" ;;
    warpschain)  # batch-1 GEMVs of Qwen3-0.6B with 2 and 1 warps a program (4 until now), in the chain
      t1() { echo "tile=4096:1024:$1,tile=1024:2048:$2,tile=6144:1024:$3,tile=1024:3072:$4"; }
      python3 benchmarks/split_decode_chain.py --batch 1 --contexts 136 384 --replays 300 \
        --variants default "$(t1 8:1024:w2 2:2048:defer:w2 4:1024:w2 1:2048:defer:w2)" \
        "$(t1 16:1024:w2 4:2048:defer:w2 8:1024:w2 2:2048:defer:w2)" \
        "$(t1 16:1024 4:2048:defer 4:1024:w2 1:2048:defer:w2)" \
        "$(t1 4:1024:w1 1:2048:defer:w1 2:1024:w1 1:2048:defer:w1)" default \
        2>&1 | grep '^{' | tee -a "$OUT/warps_chain.log" ;;
    cudachain)  # the persistent CUDA layer chain (check, times, stamps), then the engine's forward
      python3 benchmarks/cuda_layer_chain.py --layers 1 2>&1 | tee -a "$OUT/cuda_chain.log"
      python3 benchmarks/cuda_layer_chain.py --stamps --variants default ATTENTION=0 \
        NO_WEIGHTS=1 STREAM_ONLY=1 2>&1 | tee -a "$OUT/cuda_chain.log"
      python3 benchmarks/split_decode_chain.py --batch 1 --contexts 385 --replays 300 \
        --variants default none 2>&1 | grep '^{' | tee -a "$OUT/cuda_chain.log" ;;
    taggedchain)  # the CUDA layer chain, tagged data (default) against grid barriers (TAGGED=0):
      # one layer's check over three decode steps, then 28 layers twice with stamps (and three
      # steps checked), then the engine's forward
      python3 benchmarks/cuda_layer_chain.py --layers 1 --steps 3 --variants default TAGGED=0 2>&1 \
        | tee -a "$OUT/tagged_chain.log"
      for pass in 1 2; do
        python3 benchmarks/cuda_layer_chain.py --stamps --steps 3 --variants default TAGGED=0 INFLIGHT=2 \
          TAGGED=0,INFLIGHT=2 ATTENTION=0,INFLIGHT=2 TAGGED=0,ATTENTION=0,INFLIGHT=2 \
          NO_WEIGHTS=1 TAGGED=0,NO_WEIGHTS=1 2>&1 | tee -a "$OUT/tagged_chain.log"
      done
      python3 benchmarks/split_decode_chain.py --batch 1 --contexts 385 --replays 300 \
        --variants default none 2>&1 | grep '^{' | tee -a "$OUT/tagged_chain.log" ;;
    layerchain)  # the batch-1 layer kernel in the engine: its GPU tests, the 0.6B one-at-a-time
      # parity, the kernel alone once (one layer over three steps), then latency with and without
      python3 -m pytest tests/gpu/test_layer_chain_gpu.py -q -s -p no:cacheprovider 2>&1 \
        | grep -E "context|identical|passed|failed|FAILED|Error|assert" | tee "$OUT/layer_chain_tests.log"
      python3 benchmarks/cuda_layer_chain.py --layers 1 --steps 3 --replays 50 2>&1 | grep '^{' \
        | tee -a "$OUT/layer_chain_alone.jsonl"
      for pass in 1 2; do
        for flag in "" --no-persistent-decode; do
          python3 benchmarks/latency.py --shape qwen3-0.6b $flag 2>&1 | grep '^{' \
            | tee -a "$OUT/layer_chain_latency.jsonl"
        done
      done ;;
    dotprofile)  # what the dot products cost: the kernel without them (NO_DOTS) and without the
      # weight stream, then Nsight Compute's per-instruction warp samples of one launch (run 250;
      # docs/results/...run250-warp-samples.txt is this SASS page summed by stall and opcode)
      python3 benchmarks/cuda_layer_chain.py --variants default NO_DOTS=1 NO_WEIGHTS=1 \
        NO_WEIGHTS=1,NO_DOTS=1 VOCAB=1 VOCAB=1,NO_DOTS=1 2>&1 | grep '^{' | tee "$OUT/nodots.jsonl"
      timeout 300 ncu --set full --import-source yes -k regex:layer_chain -c 1 -f -o "$OUT/prof" \
        python3 benchmarks/cuda_layer_chain.py --replays 3 --variants default > "$OUT/ncu_log.txt" 2>&1
      ncu -i "$OUT/prof.ncu-rep" --page source --csv --print-source sass > "$OUT/src_sass.csv"
      rm -f "$OUT/prof.ncu-rep"
      gzip "$OUT/src_sass.csv" ;;
    dotissue)  # the dot products with one integer op per bf16 (bf16_pair) and reduce-scatter warp
      # sums against BASE (the tree before, git archive into abbase): the GPU tests, the kernel
      # alone three rounds, the engine's latency both orders (run 251, which also timed a switch
      # since removed, SCATTER_SUMS=0: bf16_pair alone)
      timeout 300 python3 -m pytest tests/gpu/test_layer_chain_gpu.py -q -s -p no:cacheprovider 2>&1 \
        | grep -E "context|identical|passed|failed|FAILED|Error|assert" | tee "$OUT/dot_tests.log"
      for round in 1 2 3; do
        ab dot_chain.jsonl benchmarks/cuda_layer_chain.py --head --variants VOCAB=1
      done
      ab dot_latency.jsonl benchmarks/latency.py --shape qwen3-0.6b
      AB_REVERSE=1 ab dot_latency.jsonl benchmarks/latency.py --shape qwen3-0.6b ;;
    dotfinal)  # the x vector unpacked by bf16_pair too and the norm's sum of squares in four chains
      # (this tree) against BASE (9b3f23c): the kernel alone three rounds (POLL_NS 192 and 320
      # twice), the GPU tests of the kernel and of the graphs' sampling, the engine's latency
      # three times (run 252)
      for round in 1 2 3; do
        ab final_chain.jsonl benchmarks/cuda_layer_chain.py --head --variants VOCAB=1
        [ $round = 3 ] || python3 benchmarks/cuda_layer_chain.py --head --variants VOCAB=1,POLL_NS=192 \
          VOCAB=1,POLL_NS=320 2>&1 | grep '^{' | tee -a "$OUT/final_chain.jsonl"
      done
      timeout 400 python3 -m pytest tests/gpu/test_layer_chain_gpu.py tests/gpu/test_graph_sampling.py \
        -q -s -p no:cacheprovider 2>&1 | grep -E "context|identical|passed|failed|FAILED|Error|assert" \
        | tee "$OUT/final_tests.log"
      for round in 1 2 3; do
        python3 benchmarks/latency.py --shape qwen3-0.6b 2>&1 | grep '^{' | tee -a "$OUT/final_latency.jsonl"
      done ;;
    samplerflaky)  # the seeded batch-of-four test three times with the kernel and three without
      # (persistent_decode=False in a copy of the test), interleaved (run 253)
      cp tests/gpu/test_graph_sampling.py /tmp/on.py
      sed 's/gpu_memory_utilization=0.5)/gpu_memory_utilization=0.5, persistent_decode=False)/' \
        /tmp/on.py > /tmp/off.py
      for i in 1 2 3; do
        for mode in on off; do
          cp /tmp/$mode.py tests/gpu/test_graph_sampling.py
          echo "== $mode $i" >> "$OUT/flaky.log"
          timeout 150 python3 -m pytest tests/gpu/test_graph_sampling.py -q -p no:cacheprovider \
            -k general_sampler 2>&1 | grep -E "passed|failed|^E " | head -3 >> "$OUT/flaky.log"
        done
      done
      cp /tmp/on.py tests/gpu/test_graph_sampling.py ;;
    determinism)  # float64 sums of squares (this tree) against BASE's float32 ones: how many
      # different sums 500 runs of one GEMV give; the seeded batch-of-four test three times; the
      # GPU tests of the GEMVs, the kernel (its greedy pick too) and the graphs' sampling (run 255)
      # (BASE lacks the script: copy it into BASE's benchmarks/ before the call)
      ab sums.jsonl benchmarks/sum_squares_repeats.py
      for i in 1 2 3; do
        timeout 150 python3 -m pytest tests/gpu/test_graph_sampling.py -q -p no:cacheprovider \
          -k general_sampler 2>&1 | grep -E "passed|failed|^E " | head -3 >> "$OUT/flaky.log"
      done
      timeout 330 python3 -m pytest tests/gpu/test_fused_kernels.py tests/gpu/test_layer_chain_gpu.py \
        tests/gpu/test_graph_sampling.py tests/gpu/test_sampling_gpu.py -q -s -p no:cacheprovider 2>&1 \
        | grep -E "context|identical|passed|failed|FAILED|Error|assert" | tee "$OUT/determinism_tests.log" ;;
    greedyab)  # the greedy batch-1 graph (the kernel's pick, no sampler launches) and float64
      # sums (this tree) against BASE: 0.6B latency in two pairs, 8B's in one (run 256)
      for pair in 1 2; do
        ab greedy_latency.jsonl benchmarks/latency.py --shape qwen3-0.6b
      done
      ab greedy_latency8b.jsonl benchmarks/latency.py --shape qwen3-8b ;;
    hostwrite)  # the greedy kernel writing its token into pinned host memory too, so the step
      # copies nothing back (this tree), against BASE (c958142, a copy after the graph): 0.6B
      # latency in two pairs; the GPU tests of the kernel, the graphs' sampling, the sampler and
      # bf16 parity; the throughput workload once (run 257)
      for pair in 1 2; do
        ab host_latency.jsonl benchmarks/latency.py --shape qwen3-0.6b
      done
      timeout 300 python3 -m pytest tests/gpu/test_layer_chain_gpu.py tests/gpu/test_graph_sampling.py \
        tests/gpu/test_sampling_gpu.py tests/gpu/test_gpu_parity.py -q -s -p no:cacheprovider 2>&1 \
        | grep -E "context|identical|passed|failed|FAILED|Error|assert" | tee "$OUT/host_tests.log"
      timeout 150 python3 benchmarks/throughput.py 2>&1 | grep -E '^\{|Error' | tee "$OUT/throughput.log" ;;
    sessioncheck)  # the GPU tests of the kernel, the graphs' sampling and the sampler (run 257's
      # ran out of time before their summary); the throughput workload, this tree against BASE
      # (dfe705d, the session's start: float32 sums at batches of 2-4) (run 258; run 259 was
      # `AB_REVERSE=1 BASE=abbase bash benchmarks/h200_run.sh abthroughput`, the pair reversed)
      timeout 250 python3 -m pytest tests/gpu/test_layer_chain_gpu.py tests/gpu/test_graph_sampling.py \
        tests/gpu/test_sampling_gpu.py -q -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/check_tests.log"
      ab check_throughput.jsonl benchmarks/throughput.py ;;
    kvlayout)  # decode attention over the workload replay with one KV head's keys of a block
      # contiguous (storage [blocks, Hkv, block_size, D]) against the engine's layout, two
      # interleaved pairs, then head-major at 32- and 64-key blocks; the GPU layer-chain tests
      # (their tie helper changed in 18f7dd9 without a GPU) (run 261)
      for pair in 1 2; do
        for flag in "" --head-major; do
          timeout 120 python3 benchmarks/decode_workload.py --quick $flag 2>&1 \
            | grep -E '^\{|Error' | tee -a "$OUT/kv_layout.jsonl"
        done
      done
      for bs in 32 64; do
        timeout 120 python3 benchmarks/decode_workload.py --quick --head-major --block-size $bs \
          2>&1 | grep -E '^\{|Error' | tee -a "$OUT/kv_layout.jsonl"
      done
      timeout 250 python3 -m pytest tests/gpu/test_layer_chain_gpu.py -v -p no:cacheprovider 2>&1 \
        | tail -25 | tee "$OUT/layer_chain_tests.log" ;;
    headmajorab)  # the engine with head-major caches (this tree: commit c392fcc, reverted after)
      # against BASE (token-major): the throughput workload in two pairs, 0.6B latency in one
      # (run 262)
      for pair in 1 2; do
        ab head_major_throughput.jsonl benchmarks/throughput.py
      done
      ab head_major_latency.jsonl benchmarks/latency.py --shape qwen3-0.6b ;;
    headmajorshuffled)  # c392fcc's pair with the free KV blocks shuffled before each run, as a
      # long-serving cache hands them out: kvlayout's replay (random blocks) had head-major ahead
      # (run 263)
      for pair in 1 2; do
        ab head_major_shuffled.jsonl benchmarks/throughput.py --block-order shuffled
      done ;;
    replayorder)  # kvlayout's replay with each sequence's blocks in a row, as the engine holds
      # them, both layouts in two interleaved pairs; then scattered, the replay's default (run 264)
      for pair in 1 2; do
        for flag in "" --head-major; do
          timeout 120 python3 benchmarks/decode_workload.py --quick --blocks-in-order $flag 2>&1 \
            | grep -E '^\{|Error' | tee -a "$OUT/replay_order.jsonl"
        done
      done
      timeout 120 python3 benchmarks/decode_workload.py --quick 2>&1 | grep -E '^\{|Error' \
        | tee -a "$OUT/replay_order.jsonl" ;;
    whereitgoes)  # where the throughput run's time goes on the current tree: the kernel profile
      # as the engine runs (programmatic launch on: overlapping times) and with it off
      # (additive), then host and device time per step by running requests (run 266)
      timeout 200 python3 benchmarks/throughput.py --profile-kernels 2>"$OUT/throughput_profile.txt" \
        | grep '^{' | tee "$OUT/throughput_profile.jsonl"
      NANOSERVE_DISABLE_PDL=1 timeout 200 python3 benchmarks/throughput.py --profile-kernels \
        2>"$OUT/throughput_profile_nopdl.txt" | grep '^{' | tee "$OUT/throughput_profile_nopdl.jsonl"
      timeout 150 python3 benchmarks/throughput.py --host-timing 2>&1 | grep '^{' \
        | tee "$OUT/host_timing.jsonl" ;;
    replayclocks)  # the replay three times with the SM clock, power and throttle reasons sampled
      # every 100 ms beside it: are its slow small-batch steps (run 264) the card's clocks? (run 267)
      nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
        --format=csv,nounits -lms 100 > "$OUT/replay_clocks.csv" 2>&1 &
      smi=$!
      for i in 1 2 3; do
        timeout 120 python3 benchmarks/decode_workload.py --quick --blocks-in-order 2>&1 \
          | grep -E '^\{|Error' | tee -a "$OUT/replay_clocks.jsonl"
      done
      kill $smi ;;
    replaygraphs)  # the replay timing CUDA-graph replays: both layouts, blocks in order, in two
      # interleaved pairs, then scattered (run 268)
      for order in --blocks-in-order --blocks-in-order ""; do
        for flag in "" --head-major; do
          timeout 120 python3 benchmarks/decode_workload.py --quick $order $flag 2>&1 \
            | grep -E '^\{|Error' | tee -a "$OUT/replay_graphs.jsonl"
        done
      done ;;
    replaysweep)  # the tunings around the default on the graph-timed replay, blocks in order,
      # twice: do run 44's ties hold now that the replay repeats within ~1%? (run 269)
      for i in 1 2; do
        timeout 250 python3 benchmarks/decode_workload.py --blocks-in-order 2>&1 \
          | grep -E '"decode_workload"|Error' | tee -a "$OUT/replay_sweep.jsonl"
      done ;;
    replayrotated)  # run 269's sweep with every tuning run once before any is timed and each
      # step's timing starting at another tuning (run 270)
      for i in 1 2; do
        timeout 250 python3 benchmarks/decode_workload.py --blocks-in-order 2>&1 \
          | grep -E '"decode_workload"|Error' | tee -a "$OUT/replay_rotated.jsonl"
      done ;;
    vocabchain)  # the kernel running the step's ends too (VOCAB=1: embedding row, final norm, LM
      # head): its GPU tests; the kernel alone with the head against the norm and cuBLAS's LM
      # head after it; then the engine's latency with and without (run 239 also timed LM head
      # rows kept in L2 by an evict-last policy, HEAD_L2_ROWS, since removed: no gain)
      timeout 300 python3 -m pytest tests/gpu/test_layer_chain_gpu.py -q -s -p no:cacheprovider 2>&1 \
        | grep -E "context|identical|passed|failed|FAILED|Error|assert" | tee "$OUT/vocab_chain_tests.log"
      timeout 150 python3 benchmarks/cuda_layer_chain.py --head --steps 3 --variants default VOCAB=1 \
        default VOCAB=1 \
        2>&1 | grep -E '^\{|Error' | tee -a "$OUT/vocab_chain_alone.jsonl"
      for pass in 1 2; do
        for flag in "" --no-persistent-decode; do
          timeout 90 python3 benchmarks/latency.py --shape qwen3-0.6b $flag 2>&1 | grep -E '^\{|Error' \
            | tee -a "$OUT/vocab_chain_latency.jsonl"
        done
      done ;;
    epiloguecheck)  # the 8-row rule's tree: all GPU tests, then two throughput pairs against BASE
      python3 -m pytest tests/gpu -q -s -p no:cacheprovider 2>&1 \
        | grep -E "identical|passed|failed|FAILED|Error" | tee "$OUT/epilogue_gpu_tests.log"
      for pair in 1 2; do
        ab ab_throughput.log benchmarks/throughput.py --budgets 16384 16384
      done ;;
  esac
done
grep -h '^{' "$OUT"/*.log > "$OUT/results.jsonl" 2>/dev/null
exit 0
