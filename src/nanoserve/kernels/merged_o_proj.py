"""Batch-1 o_proj that merges split decode's partial results as it reads its input.

Split decode leaves each head's attention as one partial result per split (the split's
normalised output and the log2 of its softmax denominator, ``decode_attention(...,
keep_partials=True)``). Elsewhere a reduce kernel merges them and o_proj then reads the merged
row. Here every o_proj program merges the heads of each K chunk it multiplies
(``merge_splits``), rounds them as the attention output is rounded, and goes on as the skinny
GEMV's residual epilogue does (``skinny_linear(..., residual=r, sum_squares=s)``): the product
is added into the residual in place and its sums of squares into ``s``. A batch-1 layer then
has one dependent launch fewer.

Every program re-reads the partials of all heads (16-bit, ``heads x splits x head_dim`` values),
so this pays only while they are few (short contexts, whose decode graphs use few splits) and
only where a shape measured faster than the reduce kernel (``TUNED``; docs/kernels.md).
Programmatically launched like the other batch-1 kernels: a program fetches its first chunk of
W before it waits for attention.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanoserve.kernels import skinny_gemm
from nanoserve.kernels.common import interpreted, programmatic_launch
from nanoserve.kernels.decode_kernels import merge_splits
from nanoserve.kernels.skinny_gemm import residual_epilogue


class MergedConfig(NamedTuple):
    """Tiles and launch options of the merging o_proj: output features per program and heads
    per K chunk."""

    block_n: int = 4
    heads_per_chunk: int = 16
    num_warps: int = 4


@triton.jit
def _merged_o_proj_kernel(
    part_lse_ptr, part_o_ptr, w_ptr, r_ptr, ss_ptr, N, stride_wn,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr, HEADS_PER_CHUNK: tl.constexpr, PDL: tl.constexpr,
    SUM_SQUARES_OUT: tl.constexpr, W_CACHE: tl.constexpr, W_EVICT: tl.constexpr,
):
    if PDL:  # the next projection may start fetching its weights
        gdc_launch_dependents()
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    h = tl.arange(0, HEADS_PER_CHUNK)
    d = tl.arange(0, HEAD_DIM)
    # W's rows as [features, heads, head_dim] tiles, matching the merged [heads, head_dim] input.
    w_rows = (w_ptr + n.to(tl.int64)[:, None, None] * stride_wn
              + (h[:, None] * HEAD_DIM + d[None, :])[None, :, :])
    w_mask = n_mask[:, None, None]
    # W depends on nothing: fetched before the wait.
    w = tl.load(w_rows, mask=w_mask, other=0.0, cache_modifier=W_CACHE, eviction_policy=W_EVICT)
    if PDL:
        gdc_wait()
    r = tl.load(r_ptr + n, mask=n_mask, other=0.0)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for chunk in tl.static_range(0, HEADS, HEADS_PER_CHUNK):
        if chunk > 0:
            w = tl.load(w_rows + chunk * HEAD_DIM, mask=w_mask, other=0.0,
                        cache_modifier=W_CACHE, eviction_policy=W_EVICT)
        x = merge_splits(part_lse_ptr, part_o_ptr, chunk + h, d, d < HEAD_DIM, SPLITS, HEAD_DIM)
        x = x.to(r_ptr.dtype.element_ty).to(tl.float32)  # rounded as attention's output is
        acc += tl.sum(tl.sum(x[None, :, :] * w.to(tl.float32), axis=2), axis=1)
    residual_epilogue(acc[None, :], r[None, :], r_ptr + n[None, :], n_mask[None, :],
                      ss_ptr + tl.arange(0, 1), tl.arange(0, 1) < 1, SUM_SQUARES_OUT)


# The shapes, (N, K), where merging in o_proj beat the reduce kernel on an H200, with their
# tiles (runs 133-134, docs/kernels.md): Qwen3-8B's o_proj. Qwen3-0.6B's (1024, 2048) lost at
# every tiling tried, so the engine keeps the reduce kernel there.
TUNED = {
    (4096, 4096): MergedConfig(block_n=16, heads_per_chunk=16, num_warps=8),
}


def default_config(num_heads: int, head_dim: int, device: torch.device) -> MergedConfig:
    """Four features per program; K chunks of up to 2048 inputs (whole heads), as the skinny
    GEMV's tuned o_proj tiles take them. For shapes outside ``TUNED`` (tests, benchmarks)."""
    if interpreted(device):
        return MergedConfig(block_n=4, heads_per_chunk=min(2, num_heads), num_warps=1)
    heads = 1
    while heads * 2 <= num_heads and num_heads % (heads * 2) == 0 and heads * 2 * head_dim <= 2048:
        heads *= 2
    return MergedConfig(heads_per_chunk=heads)


def merged_o_proj(part_lse: torch.Tensor, part_o: torch.Tensor, weight: torch.Tensor,
                  residual: torch.Tensor, sum_squares: torch.Tensor | None = None,
                  config: MergedConfig | None = None) -> torch.Tensor:
    """``residual += F.linear(attention, weight)`` for one sequence whose attention output is
    still split: ``part_lse`` ``[1, H, S]`` float32 and ``part_o`` ``[1, H, S, D]``
    (``decode_attention(..., keep_partials=True)``), ``weight`` ``[N, H * D]`` contiguous,
    ``residual`` ``[1, N]`` contiguous in ``part_o``'s dtype, updated IN PLACE and returned.
    With ``sum_squares`` (float64 ``[1]``, zero on entry) the updated row's sum of squares is
    added into it, as ``skinny_linear`` does. Capturable in a CUDA graph."""
    _, num_heads, splits, head_dim = part_o.shape
    n = weight.shape[0]
    if part_o.shape[0] != 1 or part_lse.shape != (1, num_heads, splits):
        raise ValueError(f"merged_o_proj takes one sequence's partials, got "
                         f"{tuple(part_lse.shape)} and {tuple(part_o.shape)}")
    if weight.shape[1] != num_heads * head_dim or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [N, {num_heads * head_dim}], got "
                         f"{tuple(weight.shape)}")
    if residual.shape != (1, n) or not residual.is_contiguous() or residual.dtype != part_o.dtype:
        raise ValueError(f"residual must be a contiguous [1, {n}] in {part_o.dtype}")
    if sum_squares is not None and (sum_squares.shape != (1,)
                                    or sum_squares.dtype != torch.float64):
        raise ValueError(f"sum_squares must be a float64 [1], got {tuple(sum_squares.shape)} "
                         f"in {sum_squares.dtype}")
    if triton.next_power_of_2(head_dim) != head_dim:
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    cfg = config or TUNED.get(tuple(weight.shape)) or default_config(num_heads, head_dim,
                                                                      weight.device)
    if num_heads % cfg.heads_per_chunk:
        raise ValueError(f"{cfg.heads_per_chunk} heads per chunk do not divide {num_heads}")
    pdl = programmatic_launch(weight.device)
    _merged_o_proj_kernel[(triton.cdiv(n, cfg.block_n),)](
        part_lse, part_o, weight, residual,
        sum_squares if sum_squares is not None else part_lse, n, weight.stride(0),
        HEADS=num_heads, HEAD_DIM=head_dim, SPLITS=splits, BLOCK_N=cfg.block_n,
        HEADS_PER_CHUNK=cfg.heads_per_chunk, PDL=pdl, SUM_SQUARES_OUT=sum_squares is not None,
        W_CACHE=skinny_gemm.W_LOAD[0], W_EVICT=skinny_gemm.W_LOAD[1],
        num_warps=cfg.num_warps, launch_pdl=pdl,
    )
    return residual
