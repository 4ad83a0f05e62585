"""Decode projections: the skinny GEMV's tilings against cuBLAS, with the decoder's fusions (CUDA).

For each projection of each shape (``shapes.py``) and each row count, what ``nanoserve tune``
would choose, without writing the tuning file: every candidate tiling checked against cuBLAS,
timed as CUDA-graph replays that walk copies of W past the L2. One JSON line per (shape,
projection, rows), with the best, cuBLAS's time and both as GB/s of W.

    python benchmarks/skinny_gemm.py [--shapes qwen3-0.6b qwen3-8b] [--rows 1 2 4 8]
"""
from __future__ import annotations

import argparse
import json

import torch
from nanoserve.bench.shapes import SHAPES, config_of
from transformers import AutoConfig

from nanoserve.config import ModelConfig
from nanoserve.kernels.skinny_gemm import CUBLAS
from nanoserve.kernels.tune import projection_shapes, tune_projection


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "qwen3-8b"],
                        choices=sorted(SHAPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    device = torch.device("cuda")
    for shape in args.shapes:
        fields = config_of(shape)
        cfg = ModelConfig.from_hf(AutoConfig.for_model(fields.pop("model_type"), **fields))
        for name, (n, k, fusions) in projection_shapes(cfg).items():
            for rows in args.rows:
                best, times = tune_projection(rows, n, k, fusions, device)
                best_us = min(times.values())
                print(json.dumps({
                    "bench": "skinny_gemm", "shape": shape, "proj": name, "n": n, "k": k,
                    "rows": rows, "best": best if best == CUBLAS else best._asdict(),
                    "best_us": round(best_us, 2), "cublas_us": round(times[CUBLAS], 2),
                    "best_gbs": round(2 * n * k / best_us / 1e3, 1),
                    "cublas_gbs": round(2 * n * k / times[CUBLAS] / 1e3, 1),
                    "timed": len(times)}), flush=True)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
