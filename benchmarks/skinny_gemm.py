"""Decode projections: the skinny GEMV's tilings against cuBLAS, with the decoder's fusions (CUDA).

For each projection of each shape (``shapes.py``) and each row count, what ``nanoserve tune``
would choose, without writing the tuning file: every candidate tiling checked against cuBLAS,
timed as CUDA-graph replays that walk copies of W past the L2. One JSON line per (shape,
projection, rows), with the best, cuBLAS's time and both as GB/s of W.

    python benchmarks/skinny_gemm.py [--shapes qwen3-0.6b qwen3-8b] [--rows 1 2 4 8]

``--int4``: the same for the int4 GEMV (``nanoserve tune --int4``'s candidates, group size 128)
against the tensor-core int4 kernel; GB/s counts the codes and the bf16 scales and zeros.
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


def int4_line(shape: str, name: str, n: int, k: int, rows: int, device: torch.device) -> dict:
    from nanoserve.kernels.tune_int4 import GROUP, TENSOR_CORE, tune_int4_projection

    best, times = tune_int4_projection(rows, n, k, device)
    weight_bytes = n * k // 2 + n * (k // GROUP) * 4

    def gbs(us: float) -> float:
        return round(weight_bytes / us / 1e3, 1)

    best_us = min(times.values())
    return {"bench": "int4_gemv", "shape": shape, "proj": name, "n": n, "k": k, "rows": rows,
            "best": best if best == TENSOR_CORE else best._asdict(),
            "best_us": round(best_us, 2), "tensor_core_us": round(times[TENSOR_CORE], 2),
            "best_gbs": gbs(best_us), "tensor_core_gbs": gbs(times[TENSOR_CORE]),
            "timed": len(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "qwen3-8b"],
                        choices=sorted(SHAPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--int4", action="store_true", help="the int4 GEMV instead")
    args = parser.parse_args()
    device = torch.device("cuda")
    for shape in args.shapes:
        fields = config_of(shape)
        cfg = ModelConfig.from_hf(AutoConfig.for_model(fields.pop("model_type"), **fields))
        for name, (n, k, fusions) in projection_shapes(cfg).items():
            if args.int4:
                for rows in args.rows:
                    print(json.dumps(int4_line(shape, name, n, k, rows, device)), flush=True)
                    torch.cuda.empty_cache()
                continue
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
