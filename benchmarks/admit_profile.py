"""Where the throughput workload's admitting steps (the steps that prefill) spend their time
(needs CUDA): cProfile of the host and torch.profiler (CUDA API calls, kernels), over those
steps only. Prints the admitting steps' wall times and both profiles.

    python benchmarks/admit_profile.py [--max-num-batched-tokens N] [--host-only]

``--host-only`` leaves torch.profiler off (it slows the host, and the admitting steps are
host-bound: run 65), and adds the host profile sorted by cumulative time. ``--compare`` runs the
workload twice in one process instead, with each run's admitting steps under torch.profiler's
CPU events (operators and CUDA API calls) and ``getrusage`` (page faults, context switches, CPU
time), to show what the first run's admitting steps pay that the second's do not.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import make_model_dir
from throughput import USAGE_FIELDS, workload, workload_params
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
    parser.add_argument("--compare", action="store_true")
    args = parser.parse_args()
    prompts, max_tokens = workload()
    budget = {} if args.max_num_batched_tokens is None else dict(
        max_num_batched_tokens=args.max_num_batched_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(make_model_dir("qwen3-0.6b", Path(tmp) / "m")), load_format="dummy",
                  max_num_seqs=256, **budget)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)
    params = workload_params(max_tokens)
    if args.compare:
        compare_runs(llm, prompts, params)
        return
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


class LinearCalls:
    """Wraps ``F.linear`` while active: host µs and minor page faults per call, by shape."""

    def __init__(self):
        self.plain = F.linear
        self.active = False
        self.by_shape: dict[tuple, list[float]] = {}

    def __call__(self, x, weight, bias=None):
        if not self.active:
            return self.plain(x, weight, bias)
        faults, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        out = self.plain(x, weight, bias)
        elapsed = time.perf_counter() - start
        stats = self.by_shape.setdefault((tuple(x.shape), tuple(weight.shape)), [0, 0.0, 0])
        stats[0] += 1
        stats[1] += elapsed * 1e6
        stats[2] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        return out

    def report(self, top: int = 12) -> str:
        rows = sorted(self.by_shape.items(), key=lambda kv: -kv[1][1])[:top]
        total = sum(v[1] for v in self.by_shape.values())
        lines = [f"F.linear: {sum(v[0] for v in self.by_shape.values())} calls, "
                 f"{total / 1e3:.1f} ms, {sum(v[2] for v in self.by_shape.values())} minor faults"]
        lines += [f"  x {x} w {w}: {n} calls, {us / 1e3:.2f} ms, {faults} faults"
                  for (x, w), (n, us, faults) in rows]
        return "\n".join(lines)


def compare_runs(llm: LLM, prompts: list[list[int]], params: list[SamplingParams],
                 runs: int = 2) -> None:
    """Each run's admitting phase: its wall ms, getrusage deltas and torch.profiler's CPU-side
    table (self time), printed run by run."""
    plain_step = LLMEngine.step
    linear_calls = LinearCalls()
    F.linear = linear_calls
    for run in range(1, runs + 1):
        prof = profile(activities=[ProfilerActivity.CPU])
        linear_calls.by_shape = {}
        phase: dict = {}  # the admitting phase: its first steps, from start to the first decode

        def step(self: LLMEngine, prof=prof, phase=phase):
            admitting = bool(self.scheduler.waiting)
            if admitting and not phase:
                phase.update(usage=resource.getrusage(resource.RUSAGE_SELF), steps=0,
                             start=time.perf_counter())
                prof.start()
                linear_calls.active = True
            elif not admitting and "ms" not in phase:
                linear_calls.active = False
                prof.stop()
                after = resource.getrusage(resource.RUSAGE_SELF)
                phase["ms"] = round((time.perf_counter() - phase["start"]) * 1e3, 1)
                phase["usage"] = {f: round(getattr(after, f) - getattr(phase["usage"], f), 3)
                                  for f in USAGE_FIELDS}
            phase["steps"] += admitting
            return plain_step(self)

        LLMEngine.step = step
        try:
            llm.generate(prompts, params, use_tqdm=False)
        finally:
            LLMEngine.step = plain_step
        torch.cuda.synchronize()
        print(f"run {run}: {phase['steps']} admitting steps in {phase['ms']} ms (torch.profiler "
              f"on); getrusage over them: {phase['usage']}")
        print(linear_calls.report())
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30,
                                        max_name_column_width=60))
        assert llm.reset_prefix_cache()
    F.linear = linear_calls.plain


if __name__ == "__main__":
    main()
