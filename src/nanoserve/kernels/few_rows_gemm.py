"""y = x W^T for a few rows (small decode batches) on the tensor cores, with the layer's
elementwise work in the epilogue.

At 2-64 rows a decode projection still only has to stream W once, but cuBLAS takes ~5-8 us
for Qwen3-0.6B's where the weights take 1-3, and each projection has a small kernel of its own
beside it: the add + RMSNorm after o_proj and down_proj, SiLU-and-mul after gate/up. This
kernel carries the batch-1 GEMV's fusions (``skinny_gemm``) to those batches:

- ``residual`` (o_proj, down_proj): the product is added into the residual stream in place,
  rounded as ``F.linear(...) + residual``, and each updated row's sum of squares is added into
  ``sum_squares`` (one float32 atomic per program and row) for the norm after it;
- ``sum_squares`` as input (qkv, gate/up): x is the residual stream h, the norm's weight is
  folded into W (``ColumnParallelLinear.fold_norm``), and the rows of the product are scaled
  by ``rsqrt(sum_squares / K + eps)``;
- ``gate_up``: W is ``[gate; up]`` and each program takes the same features of both halves,
  so it can write ``silu(gate) * up`` (rounded where ``F.silu(gate) * up`` rounds) instead of
  the two halves.

Each program owns ``BLOCK_N`` output features and walks all of K. x stays a plain load (a
transformed operand stops Triton's pipeliner from streaming it: docs/kernels.md, "Batch
GEMM"), so everything the layer does besides the product happens after the K loop. Under
programmatic launch the first chunk of W is requested before waiting for the kernel that
writes x.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanoserve.kernels.common import dot_precision, interpreted, programmatic_launch

# Rows the kernel serves: x's rows are the M side of one tl.dot tile (at least 16 rows, the
# smallest tile), and every program reads all of them, so past ~64 rows cuBLAS's tiling wins.
MAX_ROWS = 64


class FewRowsConfig(NamedTuple):
    """Tile sizes and launch options of one launch (BLOCK_M follows the rows)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _few_rows_kernel(
    x_ptr, w_ptr, y_ptr, r_ptr, ss_ptr,
    M, N, K, eps,
    stride_xm, stride_wn, stride_ym, stride_rm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, PDL: tl.constexpr, RMS: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
    SUM_SQUARES_OUT: tl.constexpr, GATE_UP: tl.constexpr, PRECISION: tl.constexpr,
):
    if PDL:  # the next kernel may start fetching its weights
        gdc_launch_dependents()
    pid = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    m_mask = m < M
    n_mask = n < N  # N counts output features: with GATE_UP, each half of W's rows
    x_rows = x_ptr + m[:, None] * stride_xm + k[None, :]
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn + k[None, :]
    up_rows = w_ptr + (n + N).to(tl.int64)[:, None] * stride_wn + k[None, :]  # GATE_UP: up half
    k_mask = k < K
    # The first chunk of W depends on nothing: fetched while the kernel writing x still runs.
    w = tl.load(w_rows, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    if GATE_UP:
        wu = tl.load(up_rows, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    if PDL:
        gdc_wait()
    out_mask = m_mask[:, None] & n_mask[None, :]
    if ADD_RESIDUAL:  # requested now, so that its latency hides behind the K loop
        r = tl.load(r_ptr + m[:, None] * stride_rm + n[None, :], mask=out_mask, other=0.0)
    if RMS:
        row_sum_sq = tl.load(ss_ptr + m, mask=m_mask, other=0.0)
    x = tl.load(x_rows, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
    acc = tl.dot(x, tl.trans(w), input_precision=PRECISION)
    if GATE_UP:
        acc_up = tl.dot(x, tl.trans(wu), input_precision=PRECISION)
    for k_start in range(BLOCK_K, K, BLOCK_K):
        if EVEN_K:
            x_mask = m_mask[:, None]
            w_mask = n_mask[:, None]
        else:
            k_mask = (k_start + k) < K
            x_mask = m_mask[:, None] & k_mask[None, :]
            w_mask = n_mask[:, None] & k_mask[None, :]
        x = tl.load(x_rows + k_start, mask=x_mask, other=0.0)
        w = tl.load(w_rows + k_start, mask=w_mask, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        if GATE_UP:
            wu = tl.load(up_rows + k_start, mask=w_mask, other=0.0)
            acc_up = tl.dot(x, tl.trans(wu), acc_up, input_precision=PRECISION)
    dtype = y_ptr.dtype.element_ty
    if RMS:  # norm(h) W^T = rsqrt(mean(h^2) + eps) (h W^T), the norm's weight being in W
        scale = tl.rsqrt(row_sum_sq / K + eps)[:, None]
        acc = acc * scale
        if GATE_UP:
            acc_up = acc_up * scale
    if GATE_UP:  # rounded where `F.silu(gate) * up` on the two rounded halves rounds
        gate = acc.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = act * acc_up.to(dtype).to(tl.float32)
    if ADD_RESIDUAL:  # y_ptr is the residual itself; rounded as `F.linear(...) + residual`
        acc = acc.to(dtype).to(tl.float32) + r.to(tl.float32)
    out = acc.to(dtype)
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], out, mask=out_mask)
    if SUM_SQUARES_OUT:  # this program's share of each output row's sum of squares, as stored
        stored = tl.where(out_mask, out.to(tl.float32), 0.0)
        tl.atomic_add(ss_ptr + m, tl.sum(stored * stored, axis=1), mask=m_mask, sem="relaxed")


def default_config(n: int, k: int, rows: int, gate_up: bool, device: torch.device
                   ) -> FewRowsConfig:
    """Tiles for ``n`` output features over ``k`` inputs at ``rows`` rows."""
    if interpreted(device):
        return FewRowsConfig(block_n=16, block_k=16, num_warps=1, num_stages=1)
    block_n = 16 if n <= 2048 or gate_up else 32
    block_k = 256 if rows > 16 else 512
    return FewRowsConfig(block_n, min(block_k, triton.next_power_of_2(k)), 4, 3)


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor,
                    residual: torch.Tensor | None = None,
                    sum_squares: torch.Tensor | None = None,
                    config: FewRowsConfig | None = None) -> torch.Tensor:
    """``F.linear(x, weight)`` for ``x`` of at most ``MAX_ROWS`` rows: ``x [M, K]`` with its
    last dimension contiguous, ``weight [N, K]`` with contiguous rows; a new ``[M, N]`` tensor.

    With ``residual`` (``[M, N]`` in x's dtype, contiguous rows) the product is added into it
    IN PLACE, rounded as ``F.linear(...) + residual``, and ``residual`` is returned; with
    ``sum_squares`` too (float32 ``[M]``, zero on entry) each updated row's sum of squares, as
    stored, is added into it. Launch shapes depend on shapes alone (CUDA-graph capturable).
    """
    if sum_squares is not None and residual is None:
        raise ValueError("sum_squares is the updated residual's: it needs residual")
    return _launch(x, weight, config, residual=residual, sum_squares=sum_squares)


def few_rows_rms_linear(h: torch.Tensor, sum_squares: torch.Tensor, eps: float,
                        weight: torch.Tensor, gate_up: bool = False,
                        config: FewRowsConfig | None = None) -> torch.Tensor:
    """``F.linear(h / sqrt(mean(h^2) + eps), weight)``, RMSNorm's weight folded into
    ``weight``'s columns by the caller, for an ``h`` whose rows' sums of squares the kernel that
    wrote it has taken (``few_rows_linear``'s ``sum_squares``). The norm scales the float32
    product, not h (the reference rounds the normalised row first).

    With ``gate_up``, ``weight`` is ``[gate; up]`` (``2I`` rows) and the result is the
    ``[M, I]`` ``silu(gate) * up`` of the two halves of the product.
    """
    return _launch(h, weight, config, rms_eps=eps, sum_squares=sum_squares, gate_up=gate_up)


def _launch(x: torch.Tensor, weight: torch.Tensor, config: FewRowsConfig | None,
            residual: torch.Tensor | None = None, rms_eps: float | None = None,
            sum_squares: torch.Tensor | None = None, gate_up: bool = False) -> torch.Tensor:
    """Checks, then one kernel launch."""
    m, k = x.shape
    rows_of_w = weight.shape[0]
    n = rows_of_w // 2 if gate_up else rows_of_w
    if m > MAX_ROWS:
        raise ValueError(f"few_rows_linear serves at most {MAX_ROWS} rows, got {m}")
    if (weight.shape[1] != k or (gate_up and rows_of_w % 2) or weight.stride(1) != 1
            or x.stride(1) != 1):
        raise ValueError(f"few_rows_linear needs x [M, K] and weight [N, K] ([2I, K] for "
                         f"gate_up) with contiguous rows; got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1
                                 or residual.dtype != x.dtype):
        raise ValueError(f"residual must be [{m}, {n}] in {x.dtype} with contiguous rows, got "
                         f"{tuple(residual.shape)} in {residual.dtype}")
    if sum_squares is not None and (sum_squares.shape != (m,) or sum_squares.stride(0) != 1
                                    or sum_squares.dtype != torch.float32):
        raise ValueError(f"sum_squares must be a contiguous float32 [{m}], got "
                         f"{tuple(sum_squares.shape)} in {sum_squares.dtype}")
    y = residual if residual is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    cfg = config or default_config(n, k, m, gate_up, x.device)
    pdl = programmatic_launch(x.device)
    block_k = min(cfg.block_k, max(16, triton.next_power_of_2(k)))
    _few_rows_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, y, y, sum_squares if sum_squares is not None else y,
        m, n, k, rms_eps or 0.0,
        x.stride(0), weight.stride(0), y.stride(0), y.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, PDL=pdl, RMS=rms_eps is not None,
        ADD_RESIDUAL=residual is not None,
        SUM_SQUARES_OUT=residual is not None and sum_squares is not None, GATE_UP=gate_up,
        PRECISION=dot_precision(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )
    return y
