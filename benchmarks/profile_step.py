"""Where a decode step's time goes, in batch-1 and batch-N greedy generation.

Default: cProfile of the host's Python. ``--kernels``: the device's side from torch.profiler,
kernel time per step against wall time per step (a device busy all the time has them equal),
and the kernels that take it.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import tempfile
import time
from pathlib import Path

from common import SHAPES, kernel_us, make_model_dir

from nanoserve import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--kernels", action="store_true")
    args = parser.parse_args()
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(128)] for _ in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(make_model_dir(args.shape, Path(tmp) / "m")), load_format="dummy",
                  max_num_seqs=max(8, args.batch))
        llm.generate(prompts, params, use_tqdm=False)
        if args.kernels:
            profile_kernels(llm, prompts, params, args.new_tokens, args.top)
            return
        profile = cProfile.Profile()
        profile.enable()
        llm.generate(prompts, params, use_tqdm=False)
        profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.top)
    print(f"batch={args.batch} new_tokens={args.new_tokens}")
    print(out.getvalue())


def profile_kernels(llm: LLM, prompts: list[list[int]], params: SamplingParams, steps: int,
                    top: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    events = prof.key_averages()
    print(f"batch={len(prompts)} steps={steps} wall_ms_per_step={wall / steps * 1e3:.3f} "
          f"(profiled) kernel_ms_per_step={kernel_us(events) / steps / 1e3:.3f}")
    print(events.table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=60))


if __name__ == "__main__":
    main()
