"""The fused greedy / temperature sampling kernel against the sampler's general PyTorch path
(needs CUDA).

Checks, on the GPU: greedy rows equal ``torch.argmax``; temperature draws over tokens scattered
across the whole vocabulary follow ``softmax(logits / T)``. Then times the kernel on
``[B, 151936]`` bf16 logits (Qwen3's vocabulary): eagerly with CUDA events (host launch time
included, against the general path), and as a CUDA graph replay, which is what a decode step
pays. One JSON line per check and per batch size; with ``--widths``, one more per batch size
timing the replay at each fixed number of tiles per program (``SamplingConfig``'s).

    python benchmarks/sampling.py [--widths 2 4 8 16]
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch
from nanoserve.bench.common import replay_ms

from nanoserve.kernels import sampling
from nanoserve.kernels.sampling import sample_tokens
from nanoserve.runner.sampler import _exponential_race, filter_logits
from nanoserve.runner.sampling_tensors import SamplingTensors
from nanoserve.sampling_params import SamplingParams

VOCAB = 151936
TEMPERATURE = 0.6
REPLAYS = 200


def median_us(fn: Callable[[], object], iters: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def replay_us(fn: Callable[[], object]) -> float:
    """Mean µs of one launch of ``fn`` captured in a CUDA graph, over back-to-back replays."""
    fn()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return replay_ms(graph, REPLAYS) * 1e3


def check_distribution(gen: torch.Generator) -> dict:
    """200k draws from a row whose 16 finite logits lie in different tiles of the vocabulary:
    each frequency within 5 standard errors of softmax."""
    rows, tokens = 200_000, 16
    row = torch.full((VOCAB,), float("-inf"), device="cuda")
    where = torch.randperm(VOCAB, generator=gen, device="cuda")[:tokens]
    row[where] = torch.randn(tokens, generator=gen, device="cuda") * 2
    row = row.to(torch.bfloat16)
    expected = (row[where].float() / TEMPERATURE).softmax(-1)
    temperature = torch.full((rows,), TEMPERATURE, device="cuda")
    drawn = sample_tokens(row.expand(rows, VOCAB), temperature, seed=1234)
    counts = torch.bincount(drawn, minlength=VOCAB).float()
    freq = counts[where] / rows
    sigma = (expected * (1 - expected) / rows).sqrt()
    worst = ((freq - expected).abs() / sigma.clamp_min(1e-9)).max().item()
    only_finite = counts.sum().item() == counts[where].sum().item()
    return {"check": "distribution", "worst_sigma": round(worst, 2),
            "ok": worst < 5 and only_finite}


def check_greedy(gen: torch.Generator) -> dict:
    logits = torch.randn(256, VOCAB, generator=gen, device="cuda").to(torch.bfloat16)
    tokens = sample_tokens(logits, torch.zeros(256, device="cuda"), seed=0)
    return {"check": "greedy", "ok": torch.equal(tokens, logits.argmax(-1))}


def bench(batch: int, gen: torch.Generator) -> dict:
    logits = torch.randn(batch, VOCAB, generator=gen, device="cuda").to(torch.bfloat16)
    params = [SamplingParams(temperature=TEMPERATURE)] * batch
    tensors = SamplingTensors.build(params, [[]] * batch, [[]] * batch, [[]] * batch,
                                    [None] * batch, VOCAB, torch.device("cuda"))
    seed = torch.tensor([7], device="cuda")
    tokens = torch.empty(batch, dtype=torch.int64, device="cuda")
    greedy_zero = torch.zeros(batch, device="cuda")

    def general() -> torch.Tensor:
        return _exponential_race(filter_logits(logits.float(), tensors).softmax(-1), [])

    def fused() -> torch.Tensor:
        return sample_tokens(logits, tensors.temperature, seed, out=tokens)

    def fused_greedy() -> torch.Tensor:
        return sample_tokens(logits, greedy_zero, seed, out=tokens)

    return {"bench": "sampling", "batch": batch, "temperature": TEMPERATURE,
            "general_us": round(median_us(general), 1), "fused_us": round(median_us(fused), 1),
            "fused_greedy_us": round(median_us(fused_greedy), 1),
            "fused_replay_us": round(replay_us(fused), 2),
            "fused_greedy_replay_us": round(replay_us(fused_greedy), 2)}


def bench_widths(batch: int, widths: list[int], gen: torch.Generator) -> dict:
    logits = torch.randn(batch, VOCAB, generator=gen, device="cuda").to(torch.bfloat16)
    temperature = torch.full((batch,), TEMPERATURE, device="cuda")
    seed = torch.tensor([7], device="cuda")
    tokens = torch.empty(batch, dtype=torch.int64, device="cuda")
    default = sampling.select(batch, VOCAB, logits.device)
    replays = {}
    for width in widths:
        config = default._replace(tiles_per_chunk=width)
        replays[width] = round(replay_us(
            lambda: sample_tokens(logits, temperature, seed, out=tokens, config=config)), 2)
    return {"bench": "sampling_widths", "batch": batch, "default_width": default.tiles_per_chunk,
            "replay_us_by_width": replays}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="*", default=[])
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(json.dumps(check_greedy(gen)), flush=True)
    print(json.dumps(check_distribution(gen)), flush=True)
    for batch in (1, 16, 64, 128, 256):
        print(json.dumps(bench(batch, gen)), flush=True)
        if args.widths:
            print(json.dumps(bench_widths(batch, args.widths, gen)), flush=True)


if __name__ == "__main__":
    main()
