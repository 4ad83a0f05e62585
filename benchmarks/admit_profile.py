"""Where the throughput workload's admitting steps (the steps that prefill) spend their time
(needs CUDA): cProfile of the host and torch.profiler (CUDA API calls, kernels), over those
steps only. Prints the admitting steps' wall times and both profiles.

    python benchmarks/admit_profile.py [--max-num-batched-tokens N] [--host-only]

``--host-only`` leaves torch.profiler off (it slows the host, and the admitting steps are
host-bound: run 65), and adds the host profile sorted by cumulative time.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from pathlib import Path

import torch
from common import make_model_dir
from throughput import workload
from torch.profiler import ProfilerActivity, profile

from nanoserve import LLM, SamplingParams
from nanoserve.engine.llm_engine import LLMEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the step budget (default: the offline LLM's)")
    parser.add_argument("--host-only", action="store_true")
    parser.add_argument("--runs", type=int, default=1,
                        help="profile the admitting steps of this many runs of the workload "
                             "in one process (host profile only after the first)")
    args = parser.parse_args()
    prompts, max_tokens = workload()
    budget = {} if args.max_num_batched_tokens is None else dict(
        max_num_batched_tokens=args.max_num_batched_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(make_model_dir("qwen3-0.6b", Path(tmp) / "m")), load_format="dummy",
                  max_num_seqs=256, **budget)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)
    host_profile, plain_step, times = cProfile.Profile(), LLMEngine.step, []
    device_profile = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    if not args.host_only:
        device_profile.start()
    profiling = [not args.host_only]

    def step(self: LLMEngine):
        admitting = bool(self.scheduler.waiting)
        if not admitting and profiling[0]:  # the first step with every request admitted
            torch.cuda.synchronize()
            device_profile.stop()
            profiling[0] = False
        start = time.perf_counter()
        if admitting:
            host_profile.enable()
        out = plain_step(self)
        if admitting:
            host_profile.disable()
            times.append(round((time.perf_counter() - start) * 1e3, 1))
        return out

    LLMEngine.step = step
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    print(f"admitting step ms ({'cProfile' if args.host_only else 'both profilers'} on):", times)
    pstats.Stats(host_profile).sort_stats("tottime").print_stats(25)
    for run in range(2, args.runs + 1):  # the same workload again: what the first run paid
        host_profile, times[:] = cProfile.Profile(), []
        assert llm.reset_prefix_cache()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        print(f"run {run}, admitting step ms (cProfile on):", times)
        pstats.Stats(host_profile).sort_stats("tottime").print_stats(25)
    LLMEngine.step = plain_step
    if args.host_only:
        pstats.Stats(host_profile).sort_stats("cumulative").print_stats(45)
        return
    events = device_profile.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50))
    print(events.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=50))


if __name__ == "__main__":
    main()
