"""y = x W^T for decode batches of 2 to 256 rows, weights fetched into L2 ahead of their input.

At these batch sizes a Qwen3-0.6B projection reads 4-12 MB of weights, 1-3 µs of bandwidth,
but cuBLAS takes ~6 µs for it (docs/benchmarks.md, run 45): most of a launch is ramp-up, and
nothing overlaps it, since cuBLAS kernels break the chain of programmatically launched Triton
kernels around them. This kernel is a plain tiled ``tl.dot`` GEMM (grid: row tiles x output-
feature tiles, K walked in ``BLOCK_K`` chunks) that joins that chain: on Hopper it starts
while the kernel before it still runs, asks L2 for its whole weight slab (one bulk prefetch
per thread, nothing waits for it), and only then waits for that kernel's output, x. Its
K loop then reads W from L2.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanoserve.kernels.common import dot_precision, interpreted, programmatic_launch

MAX_ROWS = 256  # the largest decode batch the engine captures
PREFETCH_ALIGN = 16  # bytes: a bulk prefetch's address and size must be multiples of this


class BatchGemmConfig(NamedTuple):
    """Tile sizes and launch options of one batch-GEMM launch."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _prefetch_to_l2(start_ptr, CHUNKS: tl.constexpr, CHUNK_BYTES: tl.constexpr):
    """Ask L2 for ``CHUNKS * CHUNK_BYTES`` contiguous bytes from ``start_ptr`` (sm_90's bulk
    prefetch: asynchronous, no completion to wait for)."""
    chunk = start_ptr.to(tl.pointer_type(tl.int8)) + tl.arange(0, CHUNKS) * CHUNK_BYTES
    tl.inline_asm_elementwise(
        "mov.u32 $0, 0;\n\tcp.async.bulk.prefetch.L2.global [$1], $2;", "=r,l,r",
        [chunk, tl.full([CHUNKS], CHUNK_BYTES, tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _batch_gemm_kernel(
    x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREFETCH_CHUNKS: tl.constexpr, PREFETCH_BYTES: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # the next kernel may start fetching what does not depend on this one
        gdc_launch_dependents()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if PREFETCH_CHUNKS > 0:  # W depends on nothing: its slab (whole rows, contiguous) goes first
        _prefetch_to_l2(w_ptr + pid_n * BLOCK_N * K, PREFETCH_CHUNKS, PREFETCH_BYTES)
    if PDL:
        gdc_wait()
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + m[:, None] * stride_xm + k[None, :]
    w_rows = w_ptr + n.to(tl.int64)[:, None] * K + k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_mask = (k_start + k) < K
        x = tl.load(x_rows + k_start, mask=(m < M)[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + k_start, mask=(n < N)[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(m < M)[:, None] & (n < N)[None, :])


def default_config(n: int, k: int, rows: int, device: torch.device) -> BatchGemmConfig:
    """Tiles for ``rows`` x ``k`` times ``k`` x ``n`` (benchmarks/decode_forward.py sweeps)."""
    if interpreted(device):
        return BatchGemmConfig(16, 16, 32, 1, 1)
    block_m = min(max(triton.next_power_of_2(rows), 16), 64)
    return BatchGemmConfig(block_m, 64, 128, 4, 3)


def prefetch_plan(cfg: BatchGemmConfig, n: int, k: int, itemsize: int, pdl: bool
                  ) -> tuple[int, int]:
    """(bulk prefetches per program, bytes each) for its W slab: one per thread, or none (no
    PDL to overlap them with, or a slab that does not split into equal 16-byte-aligned chunks)."""
    chunks = cfg.num_warps * 32
    slab = cfg.block_n * k * itemsize
    if not pdl or n % cfg.block_n or slab % (chunks * PREFETCH_ALIGN):
        return 0, 0
    return chunks, slab // chunks


def batch_linear(x: torch.Tensor, weight: torch.Tensor,
                 config: BatchGemmConfig | None = None) -> torch.Tensor:
    """``F.linear(x, weight)`` for ``x`` ``[M, K]`` with contiguous rows, ``M <= MAX_ROWS``,
    and a contiguous ``weight`` ``[N, K]``; a new ``[M, N]`` tensor in x's dtype, accumulated
    in float32. Launch shapes depend on shapes alone, so the call is CUDA-graph capturable.
    """
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"batch_linear serves at most {MAX_ROWS} rows, got {m}")
    if weight.shape[1] != k or not weight.is_contiguous() or x.stride(1) != 1:
        raise ValueError(f"batch_linear needs x [M, K] with contiguous rows and a contiguous "
                         f"weight [N, K]; got {tuple(x.shape)} and {tuple(weight.shape)}")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    cfg = config or default_config(n, k, m, x.device)
    pdl = programmatic_launch(x.device)
    chunks, chunk_bytes = prefetch_plan(cfg, n, k, x.element_size(), pdl)
    _batch_gemm_kernel[(triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))](
        x, weight, y, m, n, k, x.stride(0), y.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=min(cfg.block_k, triton.next_power_of_2(k)),
        PREFETCH_CHUNKS=chunks, PREFETCH_BYTES=chunk_bytes,
        DOT_PRECISION=dot_precision(x.dtype), PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )
    return y
