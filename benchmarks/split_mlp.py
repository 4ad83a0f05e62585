"""Batch-1 MLPs back to back: the engine's two GEMVs against the split MLP's one launch, needs CUDA.

A layer's MLP in the engine at batch 1 is two programmatically launched skinny GEMVs: gate/up
(with the norm and SiLU-and-mul) and down (with the residual add and the next norm's sum of
squares). ``kernels/split_mlp.py`` does both in one launch, each program owning some
intermediate features and adding its share of the output into a float32 row with atomics.
This times ``--layers`` MLPs of ``--shape`` chained in one CUDA graph, each layer's input the
one before's output, with every layer's weights distinct (so they come from HBM, as in the
engine), per tiling of the split MLP; ``store`` variants write per-program partial rows
instead of the atomics (wrong sums, for timing the atomics' share). Also checks one split MLP
against float64. One JSON line per variant: microseconds per layer.

    python benchmarks/split_mlp.py [--shape qwen3-0.6b] [--tiles 8:4 16:8 ...]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import SHAPES, emit, environment, graph_us

from nanoserve.kernels.skinny_gemm import skinny_linear, skinny_rms_linear
from nanoserve.kernels.split_mlp import split_mlp

EPS = 1e-6
DTYPE = torch.bfloat16


def reference_error(h, w_gate_up, w_down_t) -> float:
    """Max |split_mlp - float64| over one layer, relative to the output's largest magnitude."""
    x = h.double() / torch.sqrt(h.double().pow(2).mean() + EPS)
    gate, up = (x @ w_gate_up.double().T).chunk(2)
    ref = (F.silu(gate) * up) @ w_down_t.double()
    out = split_mlp(h, None, w_gate_up, w_down_t, torch.zeros_like(h, dtype=torch.float32), EPS)
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--tiles", nargs="+", default=["4:4", "8:4", "8:8", "16:4", "16:8", "32:8"],
                        help="split MLP tilings, features per program : warps")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w_gate_up = [torch.randn(2 * inter, hidden, generator=gen, device="cuda", dtype=DTYPE)
                 / hidden ** 0.5 for _ in range(args.layers)]
    w_down = [torch.randn(hidden, inter, generator=gen, device="cuda", dtype=DTYPE)
              / inter ** 0.5 for _ in range(args.layers)]
    w_down_t = [w.T.contiguous() for w in w_down]
    h16 = torch.randn(1, hidden, generator=gen, device="cuda", dtype=DTYPE)
    sum_squares = torch.zeros(args.layers + 1, 1, device="cuda")
    h32 = torch.randn(hidden, generator=gen, device="cuda")
    deltas = torch.zeros(args.layers, hidden, device="cuda")
    env = environment()
    base = dict(bench="split_mlp", shape=args.shape, layers=args.layers, **env)

    sum_squares[0] = h16.float().pow(2).sum()

    def engine_chain() -> None:
        sum_squares[1:].zero_()
        for i in range(args.layers):
            act = skinny_rms_linear(h16, sum_squares[i], EPS, w_gate_up[i], activate=True)
            skinny_linear(act, w_down[i], residual=h16, sum_squares=sum_squares[i + 1])

    emit({**base, "variant": "engine_gemvs",
          "us_per_layer": round(graph_us([engine_chain], args.replays) / args.layers, 3)})
    emit({**base, "variant": "check", "max_rel_error": reference_error(
        torch.randn(hidden, generator=gen, device="cuda", dtype=DTYPE), w_gate_up[0],
        w_down_t[0])})
    for tile in args.tiles:
        block_f, warps = (int(v) for v in tile.split(":"))
        programs = -(-inter // block_f)
        partials = torch.zeros(programs, hidden, device="cuda")
        for atomic in (True, False):
            def split_chain(block_f=block_f, warps=warps, atomic=atomic) -> None:
                deltas.zero_()
                for i in range(args.layers):
                    out = deltas[i] if atomic else partials
                    split_mlp(h32, deltas[i - 1] if i else None, w_gate_up[i], w_down_t[i], out,
                              EPS, block_f=block_f, num_warps=warps, atomic=atomic)

            us = graph_us([split_chain], args.replays) / args.layers
            emit({**base, "variant": f"split{'' if atomic else '_store'}", "block_f": block_f,
                  "num_warps": warps, "us_per_layer": round(us, 3)})


if __name__ == "__main__":
    main()
