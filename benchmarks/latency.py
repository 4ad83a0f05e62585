"""Batch-1 decode latency (ms per output token) against the weight-read floor. One JSON line.

``ms_per_token`` is (t(N tokens) - t(1 token)) / (N - 1), best of the repeats;
``ms_per_token_second_half`` is (t(N) - t(N / 2)) / (N / 2), which does not carry the first
token's swing between processes (added after runs 233-238; runs 239-245 report it).

``--skinny N:K:BLOCK_N:BLOCK_K[:defer][:wWARPS]`` (repeatable) replaces the batch-1 projection
tiles for an (N, K) shape, to check a sweep's winners inside the model's chain of kernels;
``--variant SPEC`` runs a split-decode variant of ``split_decode_chain.py`` (``none``: attention
left out, a profile rather than a result), for A/B runs of one tree.
"""
from __future__ import annotations

import argparse
import gc
import random
import tempfile
import time
from pathlib import Path

import torch
from common import (SHAPES, GCTimer, copy_bandwidth_gbs, emit, environment, make_model_dir,
                    replay_ms, weight_bytes)
from split_decode_chain import apply_variant, parse_tile

from nanoserve import LLM, SamplingParams
from nanoserve.kernels.skinny_gemm import TUNED_ONE_ROW
from nanoserve.runner.cuda_graph import DecodeGraphs


def time_generate(llm: LLM, prompt: list[int], new_tokens: int, repeats: int,
                  collections: list[dict] | None = None) -> list[float]:
    """Seconds of each of ``repeats`` generations; with ``collections``, each one's garbage
    collections are appended to it."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    times = []
    for _ in range(repeats):
        timer = GCTimer()
        gc.callbacks.append(timer)
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        gc.callbacks.remove(timer)
        if collections is not None:
            collections.append(timer.report())
    return times


def timed_generate(llm: LLM, prompt: list[int], new_tokens: int) -> dict:
    """One generation with every step timed on the host and the device (its decode steps:
    host ms per step, the part spent waiting for the device, the device's ms per step)."""
    from throughput import host_timing

    with host_timing(True, llm) as report:
        seconds = time_generate(llm, prompt, new_tokens, 1)[0]
    return {"ms_per_token_with_timing": round(seconds / new_tokens * 1e3, 3),
            **report["host_ms_by_running"].get("0-31", {})}


def graph_ms(llm: LLM, context: int, replays: int = 200) -> dict[str, float | None]:
    """Device time of a batch-1 decode step's CUDA graph replayed back to back, with no host
    work in between (``step_graph_ms``: the graph this benchmark's greedy steps replay, whose
    forward takes the argmax where the layer kernel runs; ``sampling_step_graph_ms``: the one
    temperature steps replay, the forward, the LM head and the sampler), and of the forward
    alone in a graph captured without them (``forward_graph_ms``), all the graphs for the last
    step's ``context``. Set against ``ms_per_token``, the difference is what the host and the
    step's other launches add."""
    runner = llm.engine.executor
    graphs = getattr(runner, "graphs", None)
    if graphs is None:
        return {"step_graph_ms": None, "sampling_step_graph_ms": None, "forward_graph_ms": None}
    # Its static inputs still hold the last step's, a valid decode; the forward-only graph
    # takes a copy of them.
    step = replay_ms(graphs.graphs[graphs.key_for(1, context, greedy=True)], replays)
    sampling_step = replay_ms(graphs.graphs[graphs.key_for(1, context)], replays)
    forward = DecodeGraphs(runner.model, 1, graphs.max_blocks, graphs.max_seq_len,
                           runner.device)
    source, target = graphs.arena.regions[1], forward.arena.regions[1]
    for name in ("positions", "slots", "seq_lens", "tables", "order"):
        getattr(target, name).copy_(getattr(source, name))
    target.token_ids.copy_(graphs.arena.int64[source.sources])  # target's rows read their own
    forward_ms = replay_ms(forward.graphs[forward.key_for(1, context)], replays)
    forward.release()
    return {"step_graph_ms": step, "sampling_step_graph_ms": sampling_step,
            "forward_graph_ms": forward_ms}


def lm_head_ms(llm: LLM, calls: int = 200) -> float | None:
    """Device time of the batch-1 LM head alone, timed over back-to-back eager calls (in the
    engine it runs inside the decode graph on one GPU, eagerly after it with tensor
    parallelism)."""
    model = getattr(llm.engine.executor, "model", None)
    if model is None:
        return None
    hidden = torch.randn(1, model.config.hidden_size, dtype=model.lm_head.weight.dtype,
                         device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    model.compute_logits(hidden)
    start.record()
    for _ in range(calls):
        model.compute_logits(hidden)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def override_skinny_tiles(specs: list[str]) -> None:
    for spec in specs:
        shape, config = parse_tile(spec)
        TUNED_ONE_ROW[shape] = config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (bf16) or fp8")
    parser.add_argument("--skinny", action="append", default=[], metavar="N:K:BN:BK[:defer][:wW]")
    parser.add_argument("--variant", default="default",
                        help="a split-decode variant (split_decode_chain.py's syntax), e.g. "
                             "caps=0,num_stages=3 or none")
    parser.add_argument("--no-persistent-decode", action="store_true",
                        help="batch-1 steps on the Triton kernels, not layer_chain.cu")
    parser.add_argument("--host-timing", action="store_true",
                        help="then as many generations again, each with its steps' host time, "
                             "wait for the device and device time (throughput.py's)")
    args = parser.parse_args()
    override_skinny_tiles(args.skinny)
    apply_variant(args.variant)
    shape = SHAPES[args.shape]
    random.seed(0)
    prompt = [random.randint(0, 10000) for _ in range(args.prompt_len)]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(args.shape, Path(tmp) / args.shape)
        llm = LLM(str(model_dir), load_format="dummy", max_num_seqs=8,
                  enforce_eager=args.enforce_eager, enable_prefix_caching=False,
                  tensor_parallel_size=args.tensor_parallel_size,
                  # Passed only when set, so that older builds (A/B runs) take the script.
                  **({"kv_cache_dtype": args.kv_cache_dtype}
                     if args.kv_cache_dtype != "auto" else {}),
                  **({"persistent_decode": False} if args.no_persistent_decode else {}))
        chain = getattr(llm.engine.executor, "model", None) and getattr(
            llm.engine.executor.model.model, "layer_chain", None)
        time_generate(llm, prompt, 8, 1)  # warm-up
        collections: list[dict] = []
        fulls = time_generate(llm, prompt, args.new_tokens, args.repeats, collections)
        firsts = time_generate(llm, prompt, 1, args.repeats)
        halves = time_generate(llm, prompt, args.new_tokens // 2, args.repeats)
        timed = [timed_generate(llm, prompt, args.new_tokens) for _ in range(args.repeats)] \
            if args.host_timing else None
        graphs = graph_ms(llm, args.prompt_len + args.new_tokens - 1)
        head_ms = lm_head_ms(llm)
        llm.close()
    bandwidth = copy_bandwidth_gbs()
    full, first = min(fulls), min(firsts)
    per_token_ms = (full - first) / (args.new_tokens - 1) * 1e3
    # The first token's time swings between processes (9-23 ms on the H200, runs 233-238),
    # and the figure above subtracts it; the second half of the tokens less the first
    # subtracts a generation that includes it too.
    late_ms = (full - min(halves)) / (args.new_tokens - args.new_tokens // 2) * 1e3
    # Each tensor-parallel GPU reads its share of the weights at the same time.
    floor_ms = weight_bytes(shape) / (bandwidth * 1e9 * args.tensor_parallel_size) * 1e3
    emit({"bench": "latency", "shape": args.shape, "prompt_len": args.prompt_len,
          "new_tokens": args.new_tokens, "ms_per_token": round(per_token_ms, 3),
          "ms_per_token_second_half": round(late_ms, 3),
          "ttft_ms": round(first * 1e3, 2), "floor_ms_per_token": round(floor_ms, 3),
          "each_run_ms_per_token": [round((t - first) / (args.new_tokens - 1) * 1e3, 3)
                                    for t in fulls],
          **{k: v and round(v, 3) for k, v in graphs.items()},
          "lm_head_ms": head_ms and round(head_ms, 4),
          "each_run_gc": collections,
          **({"host_timed_runs": timed} if timed else {}),
          "skinny_overrides": args.skinny, "variant": args.variant,
          "fraction_of_floor": round(floor_ms / per_token_ms, 3),
          "bandwidth_gbs": round(bandwidth, 1), "cuda_graphs": not args.enforce_eager,
          "tensor_parallel_size": args.tensor_parallel_size,
          "kv_cache_dtype": args.kv_cache_dtype, "layer_chain": chain is not None,
          "layer_chain_failed": chain is not None and chain.has_failed(),
          **environment()})


if __name__ == "__main__":
    main()
