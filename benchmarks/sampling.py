"""The fused Gumbel-max sampling kernel against the sampler's general PyTorch path (needs CUDA).

Checks, on the GPU: greedy rows equal ``torch.argmax``; temperature draws over a small
vocabulary follow ``softmax(logits / T)``. Then times both paths on ``[B, 151936]`` bf16 logits
(Qwen3's vocabulary) with CUDA events. One JSON line per check and per batch size.

    python benchmarks/sampling.py
"""
from __future__ import annotations

import json
import statistics
from collections.abc import Callable

import torch

from nanoserve.kernels.sampling import gumbel_max_sample
from nanoserve.runner.sampler import _exponential_race, filter_logits
from nanoserve.runner.sampling_tensors import SamplingTensors
from nanoserve.sampling_params import SamplingParams

VOCAB = 151936
TEMPERATURE = 0.6


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


def check_distribution(gen: torch.Generator) -> dict:
    """200k draws from one 16-token row: each frequency within 5 standard errors of softmax."""
    rows, vocab = 200_000, 16
    logits = torch.randn(vocab, generator=gen, device="cuda") * 2
    batch = logits.to(torch.bfloat16).expand(rows, vocab).contiguous()
    expected = (batch[0].float() / TEMPERATURE).softmax(-1)
    temperature = torch.full((rows,), TEMPERATURE, device="cuda")
    tokens = gumbel_max_sample(batch, temperature, seed=1234)
    freq = torch.bincount(tokens, minlength=vocab).float() / rows
    sigma = (expected * (1 - expected) / rows).sqrt()
    worst = ((freq - expected).abs() / sigma.clamp_min(1e-9)).max().item()
    return {"check": "distribution", "worst_sigma": round(worst, 2), "ok": worst < 5}


def check_greedy(gen: torch.Generator) -> dict:
    logits = torch.randn(256, VOCAB, generator=gen, device="cuda").to(torch.bfloat16)
    tokens = gumbel_max_sample(logits, torch.zeros(256, device="cuda"), seed=0)
    return {"check": "greedy", "ok": torch.equal(tokens, logits.argmax(-1))}


def bench(batch: int, gen: torch.Generator) -> dict:
    logits = torch.randn(batch, VOCAB, generator=gen, device="cuda").to(torch.bfloat16)
    params = [SamplingParams(temperature=TEMPERATURE)] * batch
    tensors = SamplingTensors.build(params, [[]] * batch, [[]] * batch, [[]] * batch,
                                    [None] * batch, VOCAB, torch.device("cuda"))

    def general() -> torch.Tensor:
        return _exponential_race(filter_logits(logits.float(), tensors).softmax(-1), [])

    def fused() -> torch.Tensor:
        return gumbel_max_sample(logits, tensors.temperature, seed=7)

    greedy_zero = torch.zeros(batch, device="cuda")
    return {"bench": "sampling", "batch": batch, "temperature": TEMPERATURE,
            "general_us": round(median_us(general), 1), "fused_us": round(median_us(fused), 1),
            "argmax_us": round(median_us(lambda: logits.float().argmax(-1)), 1),
            "fused_greedy_us": round(median_us(
                lambda: gumbel_max_sample(logits, greedy_zero, seed=0)), 1)}


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for row in (check_greedy(gen), check_distribution(gen), bench(1, gen), bench(64, gen),
                bench(256, gen)):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
