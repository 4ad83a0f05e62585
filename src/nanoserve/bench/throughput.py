"""Offline throughput: output tok/s on nano-vLLM's workload per shape, against floor.py's floors.

The workload: 256 requests, prompts of randint(100, 1024) random ids, max_tokens
randint(100, 1024), ignore_eos, temperature 0.6, seed 0; random bf16 weights loaded through
``LLM(folder, load_format="dummy")``. ``floor_tok_s`` is floor.py's floor for the steps the
engine's scheduler runs (each step max(bytes / copy bandwidth, FLOPs / matmul peak), the
ceilings measured once per run), ``bytes_floor_tok_s`` its bytes alone; ``fraction_of_floor``
is floor seconds / measured seconds. One JSON line per shape (per budget with ``--budgets``).

    nanoserve bench throughput --shapes qwen3-0.6b llama-3.2-3b qwen3-8b
    nanoserve bench throughput --device cpu --shapes tiny-qwen3 --num-seqs 4 \\
        --max-input-len 120 --max-output-len 110
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import resource
import sys
import time
from pathlib import Path

import torch
from nanoserve.bench.common import (GCTimer, add_deadline_argument, emit, environment, free_device_memory,
                    kernel_us, on_gpu, run_shapes, sync)
from nanoserve.bench.floor import (DEFAULT_CEILINGS, OFFLINE_MAX_NUM_BATCHED_TOKENS, measure_ceilings,
                   throughput_requests, workload_floor)
from nanoserve.bench.shapes import SHAPES, config_of, make_model_dir, tokenizer_kind

from nanoserve import LLM, SamplingParams

# getrusage fields reported per timed run: page faults, context switches, CPU seconds.
USAGE_FIELDS = ("ru_minflt", "ru_majflt", "ru_nvcsw", "ru_nivcsw", "ru_utime", "ru_stime")


def workload(num_seqs: int = 256, max_in: int = 1024, max_out: int = 1024, seed: int = 0
             ) -> tuple[list[list[int]], list[int]]:
    """nano-vLLM's prompts and max_tokens (floor.py's ``throughput_requests``)."""
    return throughput_requests(num_seqs, max_in, max_out, seed)


def workload_params(max_tokens: list[int]) -> list[SamplingParams]:
    """The workload's sampling: temperature 0.6, each request to its ``max_tokens`` (ignore_eos)."""
    return [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]


def run_transformers(model_dir: Path, prompts: list[list[int]], max_new: int) -> float:
    """Output tok/s of transformers' batched generate (left padding), capped at max_new tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                   min_new_tokens=max_new, do_sample=True, temperature=0.6, top_k=0)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return len(prompts) * max_new / elapsed


@contextlib.contextmanager
def kernel_profile(enabled: bool):
    """Yields a dict that gains ``kernel_seconds`` (device busy time) once the block ends."""
    report: dict = {}
    if not enabled:
        yield report
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield report
    events = prof.key_averages()
    report.update(kernel_seconds=round(kernel_us(events) / 1e6, 3), profiled=True)
    print(events.table(sort_by="self_device_time_total", row_limit=60, max_name_column_width=70),
          file=sys.stderr)


@contextlib.contextmanager
def host_timing(enabled: bool, llm: LLM):
    """Yields a dict that gains, per bucket of 32 running requests (decode steps only; steps
    that admit requests are one bucket of their own), the steps' mean host time, the part of it
    spent waiting for the device, and the device time of the step's own work (CUDA events
    around its launch). A host that never waits is the limit. Patches the engine's internals
    (``SampledStep.result``, ``engine.step``, the runner's ``launch``)."""
    report: dict = {}
    if not enabled:
        yield report
        return
    from nanoserve.runner.sampled_step import SampledStep

    engine, runner, waited = llm.engine, llm.engine.executor, [0.0]
    plain_result, plain_step, plain_launch = SampledStep.result, engine.step, runner.launch
    buckets: dict[str, list[float]] = {}
    launched: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
    current = [""]

    def timed_result(self):
        start = time.perf_counter()
        if self.event is not None:
            self.event.synchronize()
        waited[0] += time.perf_counter() - start
        return plain_result(self)

    def timed_launch(step):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        out = plain_launch(step)
        end.record()
        launched.append((current[0], begin, end))
        return out

    def timed_step():
        running, waited[0] = len(engine.scheduler.running), 0.0
        current[0] = "admitting" if engine.scheduler.waiting else \
            f"{running // 32 * 32}-{running // 32 * 32 + 31}"
        start = time.perf_counter()
        out = plain_step()
        bucket = buckets.setdefault(current[0], [0, 0.0, 0.0, 0.0])
        bucket[0] += 1
        bucket[1] += time.perf_counter() - start
        bucket[2] += waited[0]
        return out

    SampledStep.result, engine.step, runner.launch = timed_result, timed_step, timed_launch
    try:
        yield report
    finally:
        SampledStep.result = plain_result
        del engine.step, runner.launch
    torch.cuda.synchronize()
    for name, begin, end in launched:
        buckets[name][3] += begin.elapsed_time(end) / 1e3
    report["host_ms_by_running"] = {
        name: {"steps": n, "step_ms": round(t / n * 1e3, 3), "wait_ms": round(w / n * 1e3, 3),
               "device_ms": round(d / n * 1e3, 3)}
        for name, (n, t, w, d) in sorted(buckets.items())}


@contextlib.contextmanager
def host_profile(enabled: bool):
    """cProfile of the host over the block, its top functions by own time printed to stderr."""
    if not enabled:
        yield
        return
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        stats = pstats.Stats(profiler, stream=sys.stderr)
        stats.sort_stats("tottime").print_stats(45)
        stats.sort_stats("cumulative").print_callees(r"model_runner.py:\d+\(launch\)")
        stats.print_callees(r"llm_engine.py:\d+\(step\)")
        stats.print_callees(r"inputs.py:\d+\(flush\)")


def device_memory_stats(device: str) -> tuple[dict, dict]:
    if not on_gpu(device):
        return {}, {}
    return torch.cuda.memory_stats(), torch.cuda.host_memory_stats()


def timed_run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams],
              args: argparse.Namespace) -> tuple[float, dict]:
    """One timed pass of the workload: its seconds and the report of the options' probes."""
    with kernel_profile(args.profile_kernels) as report, \
            host_timing(args.host_timing, llm) as host_report, \
            host_profile(args.host_profile):
        allocs_before, host_before = device_memory_stats(args.device)
        collections = GCTimer()  # Python's garbage collections inside the run
        gc.callbacks.append(collections)
        usage_before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync(args.device)
        elapsed = time.perf_counter() - start
        usage_after = resource.getrusage(resource.RUSAGE_SELF)
        gc.callbacks.remove(collections)
        allocs_after, host_after = device_memory_stats(args.device)
        # cudaMalloc/cudaFree inside the run: either can stall the host until the device idles;
        # so can new pinned host blocks (cudaHostAlloc), which the host allocator then caches.
        allocs = {f"{key}_in_run": allocs_after.get(key, 0) - allocs_before.get(key, 0)
                  for key in ("num_device_alloc", "num_device_free", "num_alloc_retries")}
        allocs.update({f"{key}_in_run": round(host_after.get(key, 0) - host_before.get(key, 0), 1)
                       for key in ("num_host_alloc", "host_alloc_time.total")})
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(p.max_tokens for p in params), "every request must run to max_tokens"
    usage = {f"{field}_in_run": round(getattr(usage_after, field) - getattr(usage_before, field), 3)
             for field in USAGE_FIELDS}
    return elapsed, {**allocs, **usage, "gc": collections.report(), **report, **host_report}


def run_shape(name: str, args: argparse.Namespace, ceilings, env: dict, tmp: Path
              ) -> list[dict]:
    shape = config_of(name, args.layers)
    prompts, max_tokens = workload(args.num_seqs, args.max_input_len, args.max_output_len,
                                   args.seed)
    requests = [(len(p), n) for p, n in zip(prompts, max_tokens)]
    output_tokens = sum(max_tokens)
    budgets = args.budgets or [args.max_num_batched_tokens]
    budget = max(b or OFFLINE_MAX_NUM_BATCHED_TOKENS for b in budgets)
    model_dir = make_model_dir(name, tmp / name, num_hidden_layers=args.layers)
    extra = {}
    if args.kv_cache_dtype != "auto":
        extra["kv_cache_dtype"] = args.kv_cache_dtype
    if args.device != "auto":
        extra["device"] = args.device
    if args.gpu_memory_utilization is not None:
        extra["gpu_memory_utilization"] = args.gpu_memory_utilization
    t0 = time.perf_counter()
    llm = LLM(str(model_dir), load_format="dummy", enforce_eager=args.enforce_eager,
              max_num_seqs=max(args.num_seqs, 1), max_num_batched_tokens=budget,
              tensor_parallel_size=args.tensor_parallel_size, **extra)
    load_s = time.perf_counter() - t0
    kv_bytes = 1 if args.kv_cache_dtype.startswith("fp8") else 2
    records = []
    try:
        params = workload_params(max_tokens)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
        sync(args.device)
        for run_budget in budgets:
            if args.budgets:  # the engine was built for the largest; the scheduler takes this
                llm.engine.scheduler.max_num_batched_tokens = run_budget
                assert llm.reset_prefix_cache(), "every request of the last run has finished"
            run_budget = llm.engine.scheduler.max_num_batched_tokens  # the floor's, the engine's
            elapsed, run_report = timed_run(llm, prompts, params, args)
            floor = workload_floor(shape, requests, ceilings.bandwidth, ceilings.peak,
                                   max_num_seqs=max(args.num_seqs, 1),
                                   max_num_batched_tokens=run_budget, kv_bytes=kv_bytes,
                                   num_gpus=args.tensor_parallel_size)
            stats = llm.engine.stats()
            records.append({
                "bench": "throughput", "shape": name, "num_seqs": args.num_seqs,
                "output_tokens": output_tokens, "seconds": round(elapsed, 3),
                "output_tok_s": round(output_tokens / elapsed, 1),
                "floor_tok_s": round(output_tokens / floor.seconds, 1),
                "bytes_floor_tok_s": round(output_tokens / floor.bytes_seconds, 1),
                "fraction_of_floor": round(floor.seconds / elapsed, 3),
                "fraction_of_bytes_floor": round(floor.bytes_seconds / elapsed, 3),
                **floor.record(), "max_num_batched_tokens": run_budget,
                "num_kv_blocks": stats.num_total_blocks, "preemptions": stats.num_preemptions,
                "load_seconds": round(load_s, 1), "num_hidden_layers": shape["num_hidden_layers"],
                "cuda_graphs": on_gpu(args.device) and not args.enforce_eager,
                "tensor_parallel_size": args.tensor_parallel_size,
                "kv_cache_dtype": args.kv_cache_dtype, "tokenizer": tokenizer_kind(model_dir),
                **run_report})
    finally:
        llm.close()
        del llm
        free_device_memory()
    if args.hf_max_new:
        hf = run_transformers(model_dir, prompts, args.hf_max_new)
        records[-1].update(hf_tok_s=round(hf, 1), hf_max_new=args.hf_max_new,
                           speedup_vs_hf=round(records[-1]["output_tok_s"] / hf, 1))
        free_device_memory()
    records = [{**record, **ceilings.record(), **env} for record in records]
    for record in records:
        emit(record)
    return records


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", "--shape", nargs="+", default=["qwen3-0.6b"],
                        choices=sorted(SHAPES), metavar="SHAPE", help="default: qwen3-0.6b")
    parser.add_argument("--num-seqs", "--num-prompts", type=int, default=256,
                        help="requests (default 256)")
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=None,
                        help="override num_hidden_layers (quick checks; the floor follows)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--hf-max-new", type=int, default=0,
                        help="also time transformers' generate, capped at this many tokens")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="auto (bf16) or fp8; the floor reads the cache's own bytes")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the engine's per-step token budget (default: the offline API's)")
    parser.add_argument("--budgets", type=int, nargs="+", default=None,
                        help="time the workload once per step budget, in this order, in one "
                             "process: one engine built for the largest, the prefix cache "
                             "reset before each run (an A/B of budgets on one machine)")
    parser.add_argument("--profile-kernels", action="store_true",
                        help="also print (to stderr) the device's kernel time over the run, "
                             "by kernel; the profiler slows the host, so seconds grows")
    parser.add_argument("--host-timing", action="store_true",
                        help="also report the host's time per step and how much of it waits "
                             "for the device, by number of running requests")
    parser.add_argument("--host-profile", action="store_true",
                        help="also print (to stderr) a cProfile of the host over the run")
    parser.add_argument("--no-measure", action="store_true",
                        help="take the H200's default ceilings instead of measuring them")
    parser.add_argument("--plot", default=None, metavar="OUT.png",
                        help="also draw each shape's tok/s against its floors to this file")
    add_deadline_argument(parser)
    args = parser.parse_args(argv)

    measure = on_gpu(args.device) and not args.no_measure
    ceilings = measure_ceilings() if measure else DEFAULT_CEILINGS
    env = environment()
    records: list[dict] = []
    run_shapes("throughput", args.shapes,
               lambda shape, tmp: records.extend(run_shape(shape, args, ceilings, env, tmp)),
               args.deadline_s)
    if args.plot and records:  # nothing measured (every shape failed): no picture
        from nanoserve.bench.plot import plot_throughput

        plot_throughput(records, args.plot)


if __name__ == "__main__":
    main()
