"""y = x W^T (+ b) for the few rows of a decode step (1 to ``MAX_ROWS``), with its fusions.

At small batches a projection is a weight stream, where cuBLAS's tiles reach a fraction of the
bandwidth: each program streams ``BLOCK_N`` output features' rows of W along K on the CUDA cores.
Fusions (docs/kernels.md): ``norm_eps`` (x un-normalised, the norm's weight folded into W),
``activate`` (W = [gate; up]: writes ``silu(gate) * up``) and ``residual`` (added into in place).
W may be e4m3 with a float32 scale an output feature (``weight_scale``: FP8 weights, 16-bit x).
Which shapes take the kernel, with which tiles, is data (:func:`select`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanoserve.kernels.common import interpreted, programmatic_launch
from nanoserve.kernels.fused_ops import silu_times
from nanoserve.kernels.tuning import load_table, memoised

# Largest batch served: a broadcast [rows, BLOCK_N, BLOCK_K] product of more rows would spill.
MAX_ROWS = 8
ROW_BUCKETS = (1, 2, 4, 8)
# A tuning entry that leaves the row bucket to cuBLAS.
CUBLAS = "cublas"


class SkinnyConfig(NamedTuple):
    """Tile sizes and launch options of one skinny-GEMM launch."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    defer_sum: bool = False  # sum over K once at the end rather than once per K chunk


INTERPRETER_CONFIG = SkinnyConfig(block_n=16, block_k=32, num_warps=1, num_stages=1)


def row_bucket(rows: int) -> int:
    """The tuned row count that serves ``rows`` rows: the next of ``ROW_BUCKETS``."""
    return next(b for b in ROW_BUCKETS if b >= rows)


def shape_key(n: int, k: int) -> str:
    return f"{n}x{k}"


def heuristic_config(rows: int, n: int, k: int, weight_bytes: int = 2) -> SkinnyConfig:
    """Tiles for a shape nobody tuned: K chunks as long as possible (up to 4096) with 16 KB of
    W per chunk, less per row as rows grow, so the broadcast product stays in registers."""
    elements = max(1024, 8192 // row_bucket(rows)) * 2 // weight_bytes
    block_k = min(triton.next_power_of_2(k), 4096, elements)
    return SkinnyConfig(max(1, elements // block_k), block_k, 4, 4)


@memoised
def select(rows: int, n: int, k: int, device: torch.device) -> SkinnyConfig | None:
    """The tiles for a ``rows x k`` by ``k x n`` product, or None for cuBLAS: the device's tuning
    file's where it has the shape and row bucket, else the heuristic's for one row."""
    if not 0 < rows <= MAX_ROWS:
        return None
    if interpreted(device):
        return INTERPRETER_CONFIG
    return from_table(load_table("skinny_gemm", device), rows, n, k)


def from_table(table: dict, rows: int, n: int, k: int) -> SkinnyConfig | None:
    """:func:`select`'s rule over one tuning table (``{"NxK": {"bucket": entry}}``)."""
    entry = table.get(shape_key(n, k), {}).get(str(row_bucket(rows)))
    if entry is None:
        return heuristic_config(rows, n, k) if rows == 1 else None
    return None if entry == CUBLAS else SkinnyConfig(**entry)


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr,
    M, N, K, eps,
    stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
    DEFER_SUM: tl.constexpr, RMS: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
    ACTIVATE: tl.constexpr, W_SCALE: tl.constexpr,
):
    if PDL:  # the next projection (down after gate/up) may start fetching its weights
        gdc_launch_dependents()
    pid = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    m_mask = m < M
    if ACTIVATE:  # W = [gate; up]: rows alternate between a gate feature and its up row
        half = N // 2
        j = tl.arange(0, BLOCK_N)
        feature = pid * (BLOCK_N // 2) + j // 2
        n = feature + (j % 2) * half
        n_mask = feature < half
    else:
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < N
    x_rows = x_ptr + m[:, None] * stride_xm + k[None, :]
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn + k[None, :]
    # W depends on nothing: its first chunk is requested before waiting for x's kernel (PDL).
    # W is read once per step, so its lines go first from L1 and L2 and x and the residual stay.
    k_mask = k < K
    w = tl.load(w_rows, mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                eviction_policy="evict_first")
    if PDL:
        gdc_wait()
    out_mask = m_mask[:, None] & n_mask[None, :]
    y_rows = y_ptr + m[:, None] * stride_ym + n[None, :]
    if ADD_RESIDUAL:  # y is the residual itself; requested now, to hide behind the K loop
        r = tl.load(y_rows, mask=out_mask, other=0.0)
    x = tl.load(x_rows, mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
    if RMS:
        sum_sq = tl.sum(x * x, axis=1)
    if DEFER_SUM:
        acc3 = x[:, None, :] * w.to(tl.float32)[None, :, :]
    else:
        acc = tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    for k_start in range(BLOCK_K, K, BLOCK_K):
        if EVEN_K:
            x_mask = m_mask[:, None]
            w_mask = n_mask[:, None]
        else:
            k_mask = (k_start + k) < K
            x_mask = m_mask[:, None] & k_mask[None, :]
            w_mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + k_start, mask=w_mask, other=0.0, eviction_policy="evict_first")
        x = tl.load(x_rows + k_start, mask=x_mask, other=0.0).to(tl.float32)
        if RMS:
            sum_sq += tl.sum(x * x, axis=1)
        if DEFER_SUM:
            acc3 += x[:, None, :] * w.to(tl.float32)[None, :, :]
        else:
            acc += tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if DEFER_SUM:
        acc = tl.sum(acc3, axis=2)
    if W_SCALE:  # x (q s)^T = (x q^T) s, a scale an output feature
        acc = acc * tl.load(ws_ptr + n, mask=n_mask, other=0.0)[None, :]
    if RMS:  # norm(x) W^T = rsqrt(mean(x^2) + eps) (x W^T), the norm's weight being in W
        acc = acc * tl.rsqrt(sum_sq / K + eps)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if ACTIVATE:
        gate, up = tl.split(tl.reshape(acc.to(y_ptr.dtype.element_ty),
                                       [BLOCK_M, BLOCK_N // 2, 2]))
        features = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(y_ptr + m[:, None] * stride_ym + features[None, :], silu_times(gate, up),
                 mask=m_mask[:, None] & (features < half)[None, :])
    elif ADD_RESIDUAL:  # rounded as F.linear(...) + residual: the product first, then the sum
        out = acc.to(y_ptr.dtype.element_ty).to(tl.float32) + r.to(tl.float32)
        tl.store(y_rows, out.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(y_rows, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None, *, norm_eps: float | None = None,
                  activate: bool = False, residual: torch.Tensor | None = None,
                  weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x [M, K], weight [N, K], bias)`` for at most ``MAX_ROWS`` rows, with the
    module docstring's fusions, in float32. ``norm_eps`` scales the float32 product; ``activate``
    returns ``[M, N / 2]``; ``residual`` (``[M, N]`` in x's dtype) is added to IN PLACE and
    returned; ``weight_scale`` (``[N]`` float32) multiplies each output feature's product
    (``weight * weight_scale[:, None]`` is the weight). ``config``: the tiles (default:
    :func:`select`'s, else the heuristic's)."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"skinny_linear serves at most {MAX_ROWS} rows, got {m}")
    if weight.shape[1] != k or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"skinny_linear needs x [M, K] and weight [N, K] with contiguous rows; "
                         f"got {tuple(x.shape)} and {tuple(weight.shape)}")
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1
                                 or residual.dtype != x.dtype):
        raise ValueError(f"residual must be [{m}, {n}] in {x.dtype} with contiguous rows, got "
                         f"{tuple(residual.shape)} in {residual.dtype}")
    if activate and (n % 2 or residual is not None):
        raise ValueError(f"activate needs weight = [gate; up] (an even number of rows, got {n}) "
                         f"and no residual")
    if weight_scale is not None and (weight_scale.shape != (n,) or not weight_scale.is_contiguous()
                                     or weight_scale.dtype != torch.float32):
        raise ValueError(f"weight_scale must be [{n}] contiguous float32, got "
                         f"{tuple(weight_scale.shape)} in {weight_scale.dtype}")
    width = n // 2 if activate else n
    y = residual if residual is not None else torch.empty((m, width), dtype=x.dtype,
                                                          device=x.device)
    if m == 0:
        return y
    cfg = config or select(m, n, k, x.device) or heuristic_config(m, n, k,
                                                                  weight.element_size())
    # With activate a program's rows are half gate, half up: an even count of them.
    block_n = max(2, cfg.block_n + cfg.block_n % 2) if activate else cfg.block_n
    pdl = programmatic_launch(x.device)
    block_k = min(cfg.block_k, triton.next_power_of_2(k))
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else y, y,
        weight_scale if weight_scale is not None else y,
        m, n, k, norm_eps or 0.0,
        x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0, PDL=pdl,
        DEFER_SUM=cfg.defer_sum, RMS=norm_eps is not None, ADD_RESIDUAL=residual is not None,
        ACTIVATE=activate, W_SCALE=weight_scale is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )
    return y
