"""y = x W^T for decode batches of 2 to 256 rows, with the op before it fused in.

At these batch sizes cuBLAS spends ~6 us per projection of a Qwen3-0.6B layer where its weights
take 1-3 us to read (docs/benchmarks.md, run 45), and every projection follows a small
elementwise launch of its own: add + RMSNorm before qkv and gate/up, SiLU-and-mul before down.
This kernel is a plain tiled ``tl.dot`` GEMM (grid: output-feature tiles x row tiles, K walked
in ``BLOCK_K`` chunks) that folds those ops into how it loads x:

- ``gated``: x is ``[gate | up]`` and each chunk is ``silu(gate) * up``, rounded where
  ``F.silu(gate) * up`` rounds.
- ``batch_norm_linear``: x (+ residual) is RMS-normalised on the fly. The row's RMS needs the
  whole row, so the kernel multiplies each chunk by the norm weight only, accumulates the rows'
  sums of squares beside the product, and scales each output row by ``rsqrt(mean + eps)`` at the
  end: the same maths as normalising first, rounded once less (the normalised row is never
  materialised in 16 bits). The first feature tile's programs store x + residual.

On Hopper it is launched programmatically dependent on the kernel before it and fetches its
first W tile before waiting for that kernel's output, like the skinny GEMM (docs/kernels.md).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanoserve.kernels.common import dot_precision, interpreted, programmatic_launch

MAX_ROWS = 256  # the largest decode batch the engine captures


class BatchGemmConfig(NamedTuple):
    """Tile sizes and launch options of one batch-GEMM launch."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _x_chunk(x_rows, r_rows, sum_rows, norm_w_ptr, k_start, K, x_mask, k_offsets, ss, store_sum,
             GATED: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """One ``[BLOCK_M, BLOCK_K]`` chunk of the product's left operand, in x's dtype, and the
    rows' running sums of squares (``NORM``)."""
    x = tl.load(x_rows + k_start, mask=x_mask, other=0.0)
    dtype = x.dtype
    if GATED:
        up = tl.load(x_rows + K + k_start, mask=x_mask, other=0.0).to(tl.float32)
        gate = x.to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        x = (act * up).to(dtype)
    if NORM:
        if HAS_RESIDUAL:
            r = tl.load(r_rows + k_start, mask=x_mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
            if store_sum:
                tl.store(sum_rows + k_start, x, mask=x_mask)
        xf = x.to(tl.float32)
        ss += tl.sum(xf * xf, 1)
        norm_w = tl.load(norm_w_ptr + k_start + k_offsets, mask=(k_start + k_offsets) < K,
                         other=0.0).to(tl.float32)
        x = (xf * norm_w[None, :]).to(dtype)
    return x, ss


@triton.jit
def _batch_gemm_kernel(
    x_ptr, w_ptr, y_ptr, r_ptr, sum_ptr, norm_w_ptr,
    M, N, K, eps,
    stride_xm, stride_wn, stride_ym, stride_rm, stride_sm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GATED: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # the next kernel may start fetching what does not depend on this one
        gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    m_mask = m < M
    n_mask = n < N
    x_rows = x_ptr + m[:, None] * stride_xm + k[None, :]
    r_rows = r_ptr + m[:, None] * stride_rm + k[None, :]
    sum_rows = sum_ptr + m[:, None] * stride_sm + k[None, :]
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn + k[None, :]
    # W depends on nothing: its first chunk is fetched before waiting for the kernel writing x.
    w = tl.load(w_rows, mask=n_mask[:, None] & (k < K)[None, :], other=0.0)
    if PDL:
        gdc_wait()
    ss = tl.zeros([BLOCK_M], tl.float32)
    x, ss = _x_chunk(x_rows, r_rows, sum_rows, norm_w_ptr, 0, K,
                     m_mask[:, None] & (k < K)[None, :], k, ss, pid_n == 0,
                     GATED, NORM, HAS_RESIDUAL)
    acc = tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    for k_start in range(BLOCK_K, K, BLOCK_K):
        k_mask = (k_start + k) < K
        w = tl.load(w_rows + k_start, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x, ss = _x_chunk(x_rows, r_rows, sum_rows, norm_w_ptr, k_start, K,
                         m_mask[:, None] & k_mask[None, :], k, ss, pid_n == 0,
                         GATED, NORM, HAS_RESIDUAL)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if NORM:
        acc = acc * tl.rsqrt(ss / K + eps)[:, None]
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def default_config(n: int, k: int, rows: int, device: torch.device) -> BatchGemmConfig:
    """Tiles for ``rows`` x ``k`` times ``k`` x ``n``: untuned (benchmarks/batch_gemm.py sweeps)."""
    if interpreted(device):
        return BatchGemmConfig(16, 16, 32, 1, 1)
    block_m = min(max(triton.next_power_of_2(rows), 16), 64)
    return BatchGemmConfig(block_m, 64, 128, 4, 3)


def batch_linear(x: torch.Tensor, weight: torch.Tensor, gated: bool = False,
                 config: BatchGemmConfig | None = None) -> torch.Tensor:
    """``F.linear(x, weight)``; with ``gated``, of ``silu(gate) * up`` where x is ``[gate | up]``.

    ``x`` is ``[M, K]`` (``[M, 2K]`` when gated) with contiguous rows, ``weight`` ``[N, K]``
    contiguous; the result is a new ``[M, N]`` tensor in x's dtype, accumulated in float32.
    Launch shapes depend on shapes alone, so the call is CUDA-graph capturable.
    """
    return _launch(x, weight, config, gated=gated)[0]


def batch_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                      eps: float, weight: torch.Tensor, config: BatchGemmConfig | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.linear(rms_norm(x + residual), weight), x + residual)`` in one launch.

    Without ``residual`` it is ``(F.linear(rms_norm(x), weight), x)``. The sum goes to a new
    tensor (the programs of other feature tiles still read the old residual). ``norm_weight``
    is a contiguous ``[K]`` in x's dtype; the rest as :func:`batch_linear`.
    """
    k = x.shape[-1]
    if norm_weight.shape != (k,) or not norm_weight.is_contiguous() or norm_weight.dtype != x.dtype:
        raise ValueError(f"norm weight must be a contiguous [{k}] in {x.dtype}, got "
                         f"{tuple(norm_weight.shape)} in {norm_weight.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1
                                 or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x {tuple(x.shape)} ({x.dtype}) with contiguous "
                         f"rows, got {tuple(residual.shape)} ({residual.dtype})")
    return _launch(x, weight, config, residual=residual, norm_weight=norm_weight, eps=eps)


def _launch(x: torch.Tensor, weight: torch.Tensor, config: BatchGemmConfig | None,
            gated: bool = False, residual: torch.Tensor | None = None,
            norm_weight: torch.Tensor | None = None, eps: float = 0.0
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Checks, then one kernel launch; returns ``(y, x + residual, or x)``."""
    m, width = x.shape
    k = width // 2 if gated else width
    n = weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"batch_linear serves at most {MAX_ROWS} rows, got {m}")
    if weight.shape[1] != k or (gated and width != 2 * k) or weight.stride(1) != 1 \
            or x.stride(1) != 1:
        raise ValueError(f"batch_linear needs x [M, K] ([M, 2K] when gated) and weight [N, K] "
                         f"with contiguous rows; got {tuple(x.shape)} and {tuple(weight.shape)}")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    summed = torch.empty_like(x) if residual is not None else x
    if m == 0:
        return y, summed
    cfg = config or default_config(n, k, m, x.device)
    pdl = programmatic_launch(x.device)
    r = residual if residual is not None else x  # typed placeholders where unread
    _batch_gemm_kernel[(triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))](
        x, weight, y, r, summed, norm_weight if norm_weight is not None else y,
        m, n, k, eps,
        x.stride(0), weight.stride(0), y.stride(0), r.stride(0), summed.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=min(cfg.block_k,
                                                              triton.next_power_of_2(k)),
        GATED=gated, NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None,
        DOT_PRECISION=dot_precision(x.dtype), PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )
    return y, summed
