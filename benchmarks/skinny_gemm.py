"""Decode-sized projections: the skinny-GEMM Triton kernel against cuBLAS (``F.linear``), needs CUDA.

For each projection of the Qwen3-0.6B and Qwen3-8B shapes and each batch size, both are checked
against a float32 matmul and timed as CUDA-graph replays that cycle through enough copies of W
to defeat the L2 (in the engine every layer's W comes from HBM). ``--sweep`` also times every
tile configuration of the grid below and reports the best. ``--l2-resident`` replays one copy of
W instead, which then stays in the L2: how fast a projection would run if its weights had been
prefetched there. One JSON line per (shape, batch).

    python benchmarks/skinny_gemm.py [--sweep] [--rows 1 2 4] [--l2-resident]
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from common import graph_us

from nanoserve.kernels.skinny_gemm import SkinnyConfig, default_config, skinny_linear

# (name, N, K) of each projection: fused qkv, o, merged gate/up, down.
PROJECTIONS = {
    "qwen3-0.6b": [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024),
                   ("down", 1024, 3072)],
    "qwen3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096),
                 ("down", 4096, 12288)],
}
ROTATE_BYTES = 512 << 20  # of weight copies per graph: ~10x the H200's L2
L2_RESIDENT_CALLS = 16  # replays of one W per graph with --l2-resident
DTYPE = torch.bfloat16


def sweep_configs(k: int) -> list[SkinnyConfig]:
    """Feature blocks of 1-16 rows, K chunks of 1024-4096, summed over K per chunk or once at
    the end; 4 warps and 4 stages, which won the earlier sweep over warps and stages (run 9)."""
    block_ks = [bk for bk in (1024, 2048, 4096) if bk <= max(k, 1024)]
    return [SkinnyConfig(bn, bk, 4, 4, defer_sum=d) for bn, bk, d in
            itertools.product((1, 2, 4, 8, 16), block_ks, (False, True))]


def bench(shape: str, name: str, n: int, k: int, rows: int, sweep: bool, l2_resident: bool,
          gen: torch.Generator) -> dict:
    copies = max(2, -(-ROTATE_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, generator=gen, device="cuda", dtype=DTYPE) / k ** 0.5
               for _ in range(1 if l2_resident else copies)]
    if l2_resident:
        weights = weights * L2_RESIDENT_CALLS
    x = torch.randn(rows, k, generator=gen, device="cuda", dtype=DTYPE)
    ref = x.float() @ weights[0].float().T
    ok = True

    def check(config: SkinnyConfig | None) -> None:
        nonlocal ok
        out = skinny_linear(x, weights[0], config=config).float()
        ok = ok and torch.allclose(out, ref, atol=2e-2, rtol=2e-2)

    cublas = graph_us([lambda w=w: F.linear(x, w) for w in weights])
    check(None)
    triton_us = graph_us([lambda w=w: skinny_linear(x, w) for w in weights])
    row = {"bench": "skinny_gemm", "shape": shape, "proj": name, "n": n, "k": k, "rows": rows,
           "l2_resident": l2_resident,
           "cublas_us": round(cublas, 2), "triton_us": round(triton_us, 2),
           "default": default_config(n, k, rows, x.device)._asdict(),
           "triton_gbs": round(n * k * 2 / triton_us / 1e3, 1),
           "cublas_gbs": round(n * k * 2 / cublas / 1e3, 1)}
    if sweep:
        timed = []
        for config in sweep_configs(k):
            try:
                check(config)
                timed.append((graph_us([lambda w=w, c=config: skinny_linear(x, w, config=c)
                                        for w in weights]), config))
            except Exception:  # noqa: BLE001 - tiles past the SM's shared memory or registers
                continue
        best_us, best = min(timed)
        row.update(best_us=round(best_us, 2), best=best._asdict(),
                   top5=[(round(us, 2), tuple(c)) for us, c in sorted(timed)[:5]],
                   all=[(round(us, 2), tuple(c)) for us, c in timed])
    row["ok"] = ok
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--shapes", nargs="+", default=sorted(PROJECTIONS))
    parser.add_argument("--l2-resident", action="store_true")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes:
        for (name, n, k), rows in itertools.product(PROJECTIONS[shape], args.rows):
            print(json.dumps(bench(shape, name, n, k, rows, args.sweep, args.l2_resident, gen)),
                  flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
