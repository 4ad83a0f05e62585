"""Whether the skinny GEMV's sums of squares repeat: the same o_proj / down_proj step (residual
add, each row's sum of squares for the next norm) run many times from the same inputs, and
the number of different sums it gave. One JSON line per shape and row count.

The sums are added across programs by atomics in whatever order the programs finish; a build
whose slots are float32 (before run 255) may give several, a float64 one must give one. The
slot's dtype is the one the build accepts.
"""
from __future__ import annotations

import argparse

import torch
from common import emit, environment

from nanoserve.kernels.skinny_gemm import serves, skinny_linear

SHAPES = {"o_proj": (1024, 2048), "down": (1024, 3072), "o_proj-8b": (4096, 4096),
          "down-8b": (4096, 12288)}


def slot_dtype() -> torch.dtype:
    """float64 where the build takes it, else float32 (older builds)."""
    x = torch.zeros(1, 16, dtype=torch.bfloat16, device="cuda")
    try:
        skinny_linear(x, torch.zeros(16, 16, dtype=torch.bfloat16, device="cuda"),
                      residual=torch.zeros(1, 16, dtype=torch.bfloat16, device="cuda"),
                      sum_squares=torch.zeros(1, dtype=torch.float64, device="cuda"))
        return torch.float64
    except ValueError:
        return torch.float32


def distinct_sums(rows: int, n: int, k: int, repeats: int, dtype: torch.dtype) -> int:
    gen = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=gen).to("cuda", torch.bfloat16)
    w = torch.randn(n, k, generator=gen).div(k ** 0.5).to("cuda", torch.bfloat16)
    start = (3 * torch.randn(rows, n, generator=gen)).to("cuda", torch.bfloat16)
    sums = torch.zeros(repeats, rows, dtype=dtype, device="cuda")
    for i in range(repeats):
        skinny_linear(x, w, residual=start.clone(), sum_squares=sums[i])
    return len({tuple(row) for row in sums.tolist()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=500)
    args = parser.parse_args()
    dtype = slot_dtype()
    for name, (n, k) in SHAPES.items():
        for rows in (1, 2, 4):
            if serves(rows, n, k):
                emit({"bench": "sum_squares_repeats", "shape": name, "rows": rows,
                      "slot_dtype": str(dtype).removeprefix("torch."), "repeats": args.repeats,
                      "distinct_sums": distinct_sums(rows, n, k, args.repeats, dtype),
                      **environment()})


if __name__ == "__main__":
    main()
