"""Batch-1 decode latency: ms per output token for each shape and context, against floor.py's floor.

For each shape (random bf16 weights, loaded through ``LLM(folder, load_format="dummy")``) and
each context C: a prompt of C random ids, then greedy decoding; ``ms_per_token`` is
(t(N tokens) - t(1 token)) / (N - 1), each t the best of the repeats, so the prefill and the
first token drop out. ``ms_per_token_second_half`` is (t(N) - t(N/2)) / (N - N/2), which does not
carry the first token's swing between processes. ``floor_ms`` is floor.py's for the timed steps
(contexts C+1 .. C+N-1): max(bytes / copy bandwidth, FLOPs / matmul peak), the ceilings measured
once per run; ``fraction_of_floor`` is floor / measured. One JSON line per (shape, context).

    nanoserve bench latency --shapes qwen3-0.6b llama-3.2-3b --contexts 128 2048 8192
    nanoserve bench latency --device cpu --shapes tiny-qwen3 --contexts 16 64 --new-tokens 8
"""
from __future__ import annotations

import argparse
import functools
import gc
import random
import sys
import time
from pathlib import Path
from typing import NamedTuple

from nanoserve.bench.common import (GCTimer, add_deadline_argument, emit, environment,
                                    free_device_memory, on_gpu, replay_ms, run_shapes,
                                    step_kernel_table, sync)
from nanoserve.bench.floor import DEFAULT_CEILINGS, latency_floor, measure_ceilings
from nanoserve.bench.shapes import DENSE, SHAPES, config_of, make_model_dir, tokenizer_kind

from nanoserve import LLM, SamplingParams
from nanoserve.attention.cache_spec import cache_groups
from nanoserve.config import EngineConfig, ModelConfig
from nanoserve.models.loader import load_hf_config


def time_generate(llm: LLM, prompt: list[int], new_tokens: int, repeats: int, device: str,
                  collections: list[dict] | None = None) -> list[float]:
    """Seconds of each of ``repeats`` greedy generations of ``new_tokens`` tokens; with
    ``collections``, each one's garbage collections are appended to it."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    times = []
    for _ in range(repeats):
        timer = GCTimer()
        gc.callbacks.append(timer)
        sync(device)
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        sync(device)
        times.append(time.perf_counter() - start)
        gc.callbacks.remove(timer)
        if collections is not None:
            collections.append(timer.report())
    return times


class DecodeTiming(NamedTuple):
    """:func:`time_decode`'s result: ms per token (best run), each run's, and t(1 token) and
    t(N tokens) in seconds (best of the repeats)."""

    ms_per_token: float
    each_run_ms: list[float]
    first_s: float
    full_s: float


def time_decode(llm: LLM, prompt: list[int], new_tokens: int, repeats: int, device: str,
                collections: list[dict] | None = None) -> DecodeTiming:
    """Batch-1 greedy decode after ``prompt``: (t(N tokens) - t(1 token)) / (N - 1), each t the
    best of ``repeats``, after a warm-up at this context (the prefill and first token drop
    out); ``collections`` as :func:`time_generate`'s, for the N-token runs."""
    time_generate(llm, prompt, 8, 1, device)
    fulls = time_generate(llm, prompt, new_tokens, repeats, device, collections)
    first = min(time_generate(llm, prompt, 1, repeats, device))
    each = [(t - first) / (new_tokens - 1) * 1e3 for t in fulls]
    return DecodeTiming(min(each), each, first, min(fulls))


def step_graph_ms(llm: LLM, context: int, replays: int = 200) -> dict:
    """Device ms of the batch-1 decode graph for ``context`` keys replayed back to back, no
    host work between: set against ms_per_token, what the host adds. Reads the runner's
    internals, so it reports an error rather than failing the run where they changed."""
    try:
        graphs = getattr(llm.engine.executor, "graphs", None)
        if graphs is None:
            return {"step_graph_ms": None}
        keys = sorted(k for k in graphs.graphs if k[0] == 1 and k[1] >= context)
        # Its static inputs still hold the last step's, a valid decode.
        return {"step_graph_ms": round(replay_ms(graphs.graphs[keys[0]], replays), 4)}
    except Exception as exc:  # noqa: BLE001 (a diagnostic, never the result)
        return {"step_graph_ms": None, "step_graph_error": repr(exc)[:200]}


def engine_args(args: argparse.Namespace, model_dir: Path) -> dict:
    """Engine arguments for one shape: the cache and graphs sized for one short-lived sequence
    at the largest context, so that start-up stays short."""
    longest = max(args.contexts) + args.new_tokens + 16
    windows = ModelConfig.from_hf(load_hf_config(model_dir)).layer_windows
    # At the engine's default block size, in every cache group (a block per group of layers).
    blocks_per_seq = -(-longest // EngineConfig.block_size) * cache_groups(windows).num_groups
    extra = {}
    if args.kv_cache_dtype != "auto":
        extra["kv_cache_dtype"] = args.kv_cache_dtype
    if args.device != "auto":
        extra["device"] = args.device
    return dict(load_format="dummy", max_model_len=longest, max_num_seqs=args.max_num_seqs,
                # The longest prompt prefills in one chunk.
                max_num_batched_tokens=max(max(args.contexts), 256),
                # Two sequences' worth: no profiling pass to size the cache from free memory.
                num_kv_blocks=2 * blocks_per_seq, enable_prefix_caching=False,
                enforce_eager=args.enforce_eager,
                tensor_parallel_size=args.tensor_parallel_size, **extra)


def run_shape(name: str, args: argparse.Namespace, ceilings, env: dict, tmp: Path
              ) -> list[dict]:
    shape = config_of(name, args.layers)
    model_dir = make_model_dir(name, tmp / name, num_hidden_layers=args.layers)
    t0 = time.perf_counter()
    llm = LLM(str(model_dir), **engine_args(args, model_dir))
    load_s = time.perf_counter() - t0
    kv_bytes = 1 if args.kv_cache_dtype.startswith("fp8") else 2
    vocab = min(shape["vocab_size"], 10000)
    records: list[dict] = []
    try:
        for context in args.contexts:
            rng = random.Random(context)
            prompt = [rng.randrange(vocab) for _ in range(context)]
            collections: list[dict] = []
            timing = time_decode(llm, prompt, args.new_tokens, args.repeats, args.device,
                                 collections)
            halves = time_generate(llm, prompt, args.new_tokens // 2, args.repeats, args.device)
            ms = timing.ms_per_token
            late_ms = ((timing.full_s - min(halves)) / (args.new_tokens - args.new_tokens // 2)
                       * 1e3)
            floor = latency_floor(shape, context, ceilings.bandwidth, ceilings.peak,
                                  new_tokens=args.new_tokens, kv_bytes=kv_bytes,
                                  num_gpus=args.tensor_parallel_size)
            record = {
                "bench": "latency", "shape": name, "context": context,
                "new_tokens": args.new_tokens, "ms_per_token": round(ms, 4),
                "ms_per_token_second_half": round(late_ms, 4),
                "ttft_ms": round(timing.first_s * 1e3, 2),
                "floor_ms": round(floor.seconds * 1e3, 4),
                "floor_bytes_only_ms": round(floor.bytes_seconds * 1e3, 4),
                "fraction_of_floor": round(floor.seconds * 1e3 / ms, 3) if ms > 0 else None,
                "bytes_per_step": round(floor.bytes),
                "each_run_ms_per_token": [round(t, 4) for t in timing.each_run_ms],
                "each_run_gc": collections,
            }
            if args.graph_times:
                record.update(step_graph_ms(llm, context + args.new_tokens))
            if args.profile_kernels:
                print(f"latency: {name} at {context} keys, per decode step:", file=sys.stderr)
                run = functools.partial(time_generate, llm, prompt, args.new_tokens, 1,
                                        args.device)
                record.update(step_kernel_table(run, args.new_tokens, on_gpu(args.device)))
            records.append({**record, "num_hidden_layers": shape["num_hidden_layers"],
                            "load_seconds": round(load_s, 1),
                            "cuda_graphs": on_gpu(args.device) and not args.enforce_eager,
                            "tensor_parallel_size": args.tensor_parallel_size,
                            "kv_cache_dtype": args.kv_cache_dtype,
                            "tokenizer": tokenizer_kind(model_dir), **ceilings.record(), **env})
            emit(records[-1])
    finally:
        llm.close()
        del llm
        free_device_memory()
    return records


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", "--shape", nargs="+", default=DENSE, choices=sorted(SHAPES),
                        metavar="SHAPE", help=f"default: the dense shapes ({' '.join(DENSE)})")
    parser.add_argument("--contexts", "--prompt-len", "--input-len", nargs="+", type=int,
                        default=[128, 2048, 8192], help="prompt lengths (default 128 2048 8192)")
    parser.add_argument("--new-tokens", "--output-len", type=int, default=128,
                        help="N (default 128)")
    parser.add_argument("--repeats", "--num-iters", type=int, default=3)
    parser.add_argument("--layers", type=int, default=None,
                        help="override num_hidden_layers (quick checks; the floor follows)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--max-num-seqs", type=int, default=8,
                        help="the engine's max_num_seqs: how many batch sizes get graphs")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (bf16) or fp8")
    parser.add_argument("--graph-times", action="store_true",
                        help="also replay the batch-1 decode graph alone (the runner's internals)")
    parser.add_argument("--profile-kernels", action="store_true",
                        help="also profile one generation per context: each kernel's launches "
                             "and time per step on stderr (NANOSERVE_DISABLE_PDL=1 makes the "
                             "times add up)")
    parser.add_argument("--no-measure", action="store_true",
                        help="take the H200's default ceilings instead of measuring them")
    parser.add_argument("--plot", default=None, metavar="OUT.png",
                        help="also draw ms per token against context, with the floors")
    add_deadline_argument(parser)
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2")

    measure = on_gpu(args.device) and not args.no_measure
    ceilings = measure_ceilings() if measure else DEFAULT_CEILINGS
    env = environment()
    records: list[dict] = []
    run_shapes("latency", args.shapes,
               lambda shape, tmp: records.extend(run_shape(shape, args, ceilings, env, tmp)),
               args.deadline_s)
    if args.plot and records:  # nothing measured (every shape failed): no picture
        from nanoserve.bench.plot import plot_latency

        plot_latency(records, args.plot)


if __name__ == "__main__":
    main()
