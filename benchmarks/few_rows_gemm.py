"""Small decode batches' projections: the few-rows Triton GEMM with its fused epilogues against
the engine's path before it (cuBLAS, split-K, and the norm / SiLU launches beside them); needs
CUDA.

Per projection of the Qwen3-0.6B and Qwen3-8B shapes and per batch, each side does the same
work: qkv (normalised input), o_proj (added into the residual, then the add + RMSNorm), gate/up
(normalised input, then SiLU-and-mul), down (likewise o_proj). Both are checked against each
other and timed as CUDA-graph replays cycling through enough copies of W to defeat the L2.
``--sweep`` also times the tilings below. One JSON line per (shape, projection, rows).

    python benchmarks/few_rows_gemm.py [--sweep] [--rows 2 8 16 32 64] [--shapes qwen3-0.6b]
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from common import graph_us

from nanoserve.kernels.few_rows_gemm import (FewRowsConfig, default_config, few_rows_linear,
                                             few_rows_rms_linear)
from nanoserve.kernels.fused_ops import add_rms_norm, silu_and_mul
from nanoserve.layers.norm import PartialSums
from nanoserve.layers.split_k import split_k_partial_sums

# (name, N, K) of each projection; for gate_up N counts both halves.
PROJECTIONS = {
    "qwen3-0.6b": [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024),
                   ("down", 1024, 3072)],
    "qwen3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096),
                 ("down", 4096, 12288)],
}
ROTATE_BYTES = 512 << 20  # of weight copies per graph: ~10x the H200's L2
DTYPE = torch.bfloat16
EPS = 1e-6


def sweep_configs() -> list[FewRowsConfig]:
    """Feature blocks of 16-64 rows, K chunks of 64-256 with deeper pipelines for shorter
    chunks."""
    return [FewRowsConfig(bn, bk, 4, stages) for bn in (16, 32, 64)
            for bk, stages in ((64, 5), (128, 4), (256, 3))]


def engine_before(name: str, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor,
                  norm_weight: torch.Tensor):
    """The engine's path before the few-rows kernel, for one projection and what follows it."""
    if name in ("o", "down"):
        out = split_k_partial_sums(x, w, None)
        from nanoserve.kernels.fused_ops import add_rms_norm_parts
        if isinstance(out, PartialSums):
            return add_rms_norm_parts(out.parts, residual, norm_weight, EPS)
        return add_rms_norm(F.linear(x, w), residual, norm_weight, EPS)
    out = F.linear(x, w)
    return silu_and_mul(out) if name == "gate_up" else out


def few_rows(name: str, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor,
             sum_squares: torch.Tensor, config: FewRowsConfig | None):
    if name in ("o", "down"):
        return few_rows_linear(x, w, residual=residual, sum_squares=sum_squares, config=config)
    return few_rows_rms_linear(x, sum_squares, EPS, w, gate_up=name == "gate_up",
                               config=config)


def bench(shape: str, name: str, n: int, k: int, rows: int, sweep: bool,
          gen: torch.Generator) -> dict:
    copies = max(2, -(-ROTATE_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, generator=gen, device="cuda", dtype=DTYPE) / k ** 0.5
               for _ in range(copies)]
    x = torch.randn(rows, k, generator=gen, device="cuda", dtype=DTYPE)
    out_width = n // 2 if name == "gate_up" else n
    residual = torch.randn(rows, out_width, generator=gen, device="cuda", dtype=DTYPE)
    norm_weight = torch.ones(out_width, device="cuda", dtype=DTYPE)
    sum_squares = x.float().pow(2).sum(-1) if name in ("qkv", "gate_up") else \
        torch.zeros(rows, device="cuda")
    # The check: the product (and activation) against float32 on unit-norm rows.
    if name in ("qkv", "gate_up"):
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)
        ref = normed @ weights[0].float().T
        if name == "gate_up":
            gate, up = ref.chunk(2, dim=-1)
            ref = F.silu(gate) * up

    def check(config: FewRowsConfig | None) -> bool:
        if name in ("o", "down"):
            r = residual.clone()
            few_rows_linear(x, weights[0], residual=r, config=config)
            return torch.allclose(r.float(), (x.float() @ weights[0].float().T + residual.float()),
                                  atol=5e-2, rtol=2e-2)
        out = few_rows(name, x, weights[0], residual, sum_squares, config).float()
        return torch.allclose(out, ref, atol=5e-2, rtol=2e-2)

    before = graph_us([lambda w=w: engine_before(name, x, w, residual, norm_weight)
                       for w in weights])
    ok = check(None)
    after = graph_us([lambda w=w: few_rows(name, x, w, residual, sum_squares, None)
                      for w in weights])
    row = {"bench": "few_rows_gemm", "shape": shape, "proj": name, "n": n, "k": k, "rows": rows,
           "engine_before_us": round(before, 2), "few_rows_us": round(after, 2),
           "default": default_config(out_width, k, rows, name == "gate_up", x.device)._asdict(),
           "few_rows_gbs": round(n * k * 2 / after / 1e3, 1)}
    if sweep:
        timed = []
        for config in sweep_configs():
            try:
                if not check(config):
                    continue
                timed.append((graph_us([lambda w=w, c=config: few_rows(
                    name, x, w, residual, sum_squares, c) for w in weights]), config))
            except Exception:  # noqa: BLE001 - tiles past the SM's shared memory or registers
                continue
        best_us, best = min(timed)
        row.update(best_us=round(best_us, 2), best=best._asdict(),
                   top5=[(round(us, 2), tuple(c)) for us, c in sorted(timed)[:5]])
    row["ok"] = ok
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 8, 16, 32, 64])
    parser.add_argument("--shapes", nargs="+", default=sorted(PROJECTIONS))
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes:
        for (name, n, k), rows in itertools.product(PROJECTIONS[shape], args.rows):
            print(json.dumps(bench(shape, name, n, k, rows, args.sweep, gen)), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
