"""Fused elementwise ops on the GPU: nanoserve's Triton kernels against torch.compile of the same
PyTorch formulas (the layers' CPU paths), at Qwen3-0.6B and Qwen3-8B widths (needs CUDA).

Each pair is first checked for equal results, then timed the way the engine runs decode: as
CUDA-graph replays, ``--reps`` calls per graph, so launch cost counts as it does in the engine.
One JSON line per (op, shape, tokens).

    python benchmarks/fused_ops.py [--tokens 1 256 8192]
"""
from __future__ import annotations

import argparse
import json

import torch
from common import graph_us

from nanoserve.kernels.fused_ops import add_rms_norm, rms_norm, silu_and_mul
from nanoserve.layers.activation import silu_and_mul_torch
from nanoserve.layers.norm import add_rms_norm_torch, rms_norm_torch

EPS = 1e-6
# hidden, intermediate
WIDTHS = {"qwen3-0.6b": (1024, 3072), "qwen3-8b": (4096, 12288)}


def cases(width: str, tokens: int, gen: torch.Generator):
    """(op, triton fn, torch fn, inputs factory): the factory gives fresh inputs per use, since
    add_rms_norm writes its residual in place."""
    hidden, inter = WIDTHS[width]
    dev, dt = "cuda", torch.bfloat16

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=dev, dtype=dt)

    weight = rand(hidden)
    yield ("rms_norm", lambda x: rms_norm(x, weight, EPS),
           lambda x: rms_norm_torch(x, weight, EPS), lambda: (rand(tokens, hidden),))
    yield ("add_rms_norm", lambda x, r: add_rms_norm(x, r, weight, EPS),
           lambda x, r: add_rms_norm_torch(x, r, weight, EPS),
           lambda: (rand(tokens, hidden), rand(tokens, hidden)))
    yield ("silu_and_mul", silu_and_mul, silu_and_mul_torch, lambda: (rand(tokens, 2 * inter),))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 256, 8192])
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    # Each (op, width, tokens) compiles its own graph; stay under dynamo's recompile limit.
    torch._dynamo.config.cache_size_limit = 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    for width in WIDTHS:
        for tokens in args.tokens:
            for op, triton_fn, torch_fn, make in cases(width, tokens, gen):
                compiled = torch.compile(torch_fn, dynamic=False)
                inputs = make()
                want = torch_fn(*make_copy(inputs))
                for got in (triton_fn(*make_copy(inputs)), compiled(*make_copy(inputs))):
                    for a, b in zip(as_tuple(got), as_tuple(want)):
                        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
                record = {"bench": "fused_ops", "op": op, "width": width, "tokens": tokens,
                          "triton_us": graph_us([lambda: triton_fn(*inputs)] * args.reps),
                          "compile_us": graph_us([lambda: compiled(*inputs)] * args.reps),
                          "eager_us": graph_us([lambda: torch_fn(*inputs)] * args.reps)}
                record = {k: round(v, 2) if isinstance(v, float) else v
                          for k, v in record.items()}
                print(json.dumps(record), flush=True)


def make_copy(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.clone() for t in inputs)


def as_tuple(x: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


if __name__ == "__main__":
    main()
