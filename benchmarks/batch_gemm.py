"""Decode projections at 16-256 rows: the batch-GEMM Triton kernel against cuBLAS, needs CUDA.

For each projection of the shape and each batch size: cuBLAS (``F.linear``) alone; what the
engine runs today, the fused add + RMSNorm (before qkv, gate/up) or SiLU-and-mul (before down)
kernel and then cuBLAS; the Triton kernel plain, and with that op folded in. All timed as
CUDA-graph replays cycling through enough copies of W to defeat the L2, as in
``skinny_gemm.py``; the Triton kernel runs with programmatic launch where the device has it, as
the engine would. ``--sweep`` also times a few tilings of the plain kernel. One JSON line per
(projection, rows).

    python benchmarks/batch_gemm.py [--rows 16 64 128 256] [--shapes qwen3-0.6b] [--sweep]
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from common import graph_us
from skinny_gemm import DTYPE, PROJECTIONS, ROTATE_BYTES

from nanoserve.kernels.batch_gemm import (BatchGemmConfig, batch_linear, batch_norm_linear,
                                          default_config)
from nanoserve.kernels.fused_ops import add_rms_norm, silu_and_mul

PROLOGUE = {"qkv": "norm", "gate_up": "norm", "down": "gated", "o": None}


def sweep_configs(rows: int) -> list[BatchGemmConfig]:
    block_m = min(max(1 << (rows - 1).bit_length(), 16), 64)
    configs = [BatchGemmConfig(block_m, bn, bk, 4, s) for bn, bk, s in
               [(32, 128, 4), (64, 64, 4), (128, 64, 3), (32, 256, 3), (16, 256, 4)]]
    if rows >= 128:
        configs.append(BatchGemmConfig(128, 64, 64, 8, 3))
    return configs


def bench(shape: str, name: str, n: int, k: int, rows: int, sweep: bool,
          gen: torch.Generator) -> dict:
    copies = max(2, -(-ROTATE_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, generator=gen, device="cuda", dtype=DTYPE) / k ** 0.5
               for _ in range(copies)]
    prologue = PROLOGUE[name]
    width = 2 * k if prologue == "gated" else k
    x = torch.randn(rows, width, generator=gen, device="cuda", dtype=DTYPE)
    residual = torch.randn(rows, k, generator=gen, device="cuda", dtype=DTYPE)
    norm_w = 1 + 0.1 * torch.randn(k, generator=gen, device="cuda", dtype=DTYPE)
    eps = 1e-6

    ref = F.linear(x if prologue != "gated" else silu_and_mul(x), weights[0]).float()
    plain_x = x if prologue != "gated" else x[:, :k]
    ok = torch.allclose(batch_linear(plain_x, weights[0]).float(),
                        F.linear(plain_x, weights[0]).float(), atol=3e-2, rtol=3e-2)
    row = {"bench": "batch_gemm", "shape": shape, "proj": name, "n": n, "k": k, "rows": rows,
           "prologue": prologue, "default": default_config(n, k, rows, x.device)._asdict(),
           "cublas_us": round(graph_us([lambda w=w: F.linear(plain_x, w) for w in weights]), 2),
           "triton_us": round(graph_us([lambda w=w: batch_linear(plain_x, w)
                                        for w in weights]), 2)}
    if prologue == "gated":
        ok = ok and torch.allclose(batch_linear(x, weights[0], gated=True).float(), ref,
                                   atol=3e-2, rtol=3e-2)
        row["engine_us"] = graph_us([lambda w=w: F.linear(silu_and_mul(x), w) for w in weights])
        row["fused_us"] = graph_us([lambda w=w: batch_linear(x, w, gated=True) for w in weights])
    elif prologue == "norm":
        expected = F.linear(add_rms_norm(x, residual.clone(), norm_w, eps)[0], weights[0])
        fused = batch_norm_linear(x, residual, norm_w, eps, weights[0])[0]
        ok = ok and torch.allclose(fused.float(), expected.float(), atol=5e-2, rtol=5e-2)
        scratch = residual.clone()  # the engine's kernel adds into it in place
        row["engine_us"] = graph_us([lambda w=w: F.linear(add_rms_norm(x, scratch, norm_w, eps)[0],
                                                          w) for w in weights])
        row["fused_us"] = graph_us([lambda w=w: batch_norm_linear(x, residual, norm_w, eps, w)
                                    for w in weights])
    for key in ("engine_us", "fused_us"):
        if key in row:
            row[key] = round(row[key], 2)
    if sweep:
        timed = [(graph_us([lambda w=w, c=c: batch_linear(plain_x, w, config=c)
                            for w in weights]), c) for c in sweep_configs(rows)]
        row["sweep"] = [(round(us, 2), tuple(c)) for us, c in sorted(timed)]
    row["ok"] = ok
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128, 256])
    parser.add_argument("--shapes", nargs="+", default=["qwen3-0.6b"])
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes:
        for (name, n, k), rows in itertools.product(PROJECTIONS[shape], args.rows):
            print(json.dumps(bench(shape, name, n, k, rows, args.sweep, gen)), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
