"""Split-K decode projections: a narrow projection's K cut into slices, run as one batched GEMM.

At decode batches of 2-256 rows cuBLAS runs a 1024-wide projection (Qwen3-0.6B's o_proj and
down_proj) as a few output tiles, each walking all of K: ~6-8 us where the weights take ~1.5.
As ``S`` slices of K in one strided batched GEMM (views, no copies) it has S times the
programs. The float32 partial sums go, as :class:`PartialSums`, to the add + RMSNorm that
follows these projections anyway, which adds them up in its own launch (docs/kernels.md,
"Split-K narrow projections").
"""
from __future__ import annotations

import torch

from nanoserve.layers.norm import PartialSums

# Decode-size batches (the CUDA graphs' range) whose narrow projections run split-K.
SPLIT_K_MAX_ROWS = 256
# Only outputs this narrow (the width measured to gain): there cuBLAS runs few output tiles,
# each with a long K loop (Qwen3-0.6B's o_proj and down_proj). 4096-wide ones tie or lose up
# to 64 rows and gain ~3% at 256 (run 64).
SPLIT_K_MAX_FEATURES = 1024


def split_k_parts(rows: int, out_features: int, in_features: int) -> int:
    """Slices of K for a split-K projection of ``rows`` rows (1: not split).

    Measured on the H200 (run 63, ``benchmarks/split_k.py``): with the partial sums added by
    the RMSNorm launch after it, 4 slices up to 128 rows and 2 above take 1.0-1.6 us off each
    o_proj / down_proj + add + RMSNorm pair of Qwen3-0.6B (6.3-8.3 us against 6.9-9.8).
    """
    if not 2 <= rows <= SPLIT_K_MAX_ROWS or out_features > SPLIT_K_MAX_FEATURES:
        return 1
    parts = 4 if rows <= 128 else 2
    # Every slice's first element stays 16-byte aligned for cuBLAS.
    return parts if in_features % (8 * parts) == 0 else 1


def split_k_views(x: torch.Tensor, weight: torch.Tensor, parts: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` and ``weight [N, K]`` as ``[S, M, K/S]`` and ``[S, K/S, N]`` views (no
    copies) of K's ``S`` slices: ``bmm`` of them, summed over S, is ``x @ weight.T``."""
    (rows, k), n = x.shape, weight.shape[0]
    return (x.view(rows, parts, k // parts).transpose(0, 1),
            weight.view(n, parts, k // parts).permute(1, 2, 0))


def split_k_partial_sums(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                         ) -> PartialSums | None:
    """``x @ weight.T`` as float32 partial sums over slices of K, for decode-size 16-bit
    batches on CUDA where :func:`split_k_parts` says so; None where the projection should run
    whole (``layers.linear.linear``)."""
    rows = x.shape[0] if x.dim() == 2 else 0
    if (not x.is_cuda or bias is not None or x.dtype not in (torch.bfloat16, torch.float16)
            or (parts := split_k_parts(rows, *weight.shape)) == 1):
        return None
    return PartialSums(torch.bmm(*split_k_views(x, weight, parts), out_dtype=torch.float32))
