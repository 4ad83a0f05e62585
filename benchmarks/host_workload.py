"""Host seconds of the throughput workload with no model: the engine and the runner's Python.

The throughput benchmark's 256 requests run through the real LLMEngine, scheduler, block
manager, ModelRunner input preparation and sampling tensors, on the CPU; only the model's
forward and the sampler are stubs (zeros, random ids), so what is timed is the host work that
a GPU run must hide behind the device (at 128+ running requests it does not: run 53 in
docs/benchmarks.md). Prints one JSON line; ``--profile`` also prints a cProfile to stderr.

    python benchmarks/host_workload.py [--num-seqs 256] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import SHAPES, emit, make_model_dir
from throughput import workload, workload_params

from nanoserve import LLM
from nanoserve.runner.sampler import SamplerOutput


class StubModel(torch.nn.Module):
    """Hidden states of zeros and one-column logits: a forward that costs nothing."""

    def __init__(self, hidden: int):
        super().__init__()
        self.hidden = hidden

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return torch.zeros(ids.shape[0], self.hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[:, :1]


def stub_sampler(logits: torch.Tensor, tensors) -> SamplerOutput:
    return SamplerOutput(torch.randint(0, 10000, (logits.shape[0],)), None, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    prompts, max_tokens = workload(args.num_seqs)
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(make_model_dir("tiny-qwen3", Path(tmp) / "m")), load_format="dummy",
                  device="cpu", max_num_seqs=args.num_seqs, num_kv_blocks=80000)
    runner = llm.engine.executor
    runner.model = StubModel(SHAPES["tiny-qwen3"]["hidden_size"])
    runner.sampler = stub_sampler
    params = workload_params(max_tokens)
    profiler = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if profiler:
        profiler.disable()
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(max_tokens)
    emit({"bench": "host_workload", "num_seqs": args.num_seqs, "output_tokens": produced,
          "host_seconds": round(elapsed, 3), "profiled": args.profile,
          "date": time.strftime("%Y-%m-%d")})
    if profiler:
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(40)


if __name__ == "__main__":
    main()
