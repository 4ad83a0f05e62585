"""y = x W^T with W held as 4-bit codes (two a byte, the even input feature in the low nibble)
and a scale and zero per group of input features: ``W = (q - 8) * scale + zero`` (AWQ, GPTQ
and GGUF's 4-bit types repacked at load, ``layers/quantization/packed.py``).

:func:`int4_linear` picks the path by rows (:func:`int4_path`): up to 8 the skinny GEMV
(``int4_gemv.py``), which streams the codes on the CUDA cores; then the tensor-core kernel here,
whose programs dequantize a ``BLOCK_N x BLOCK_K`` tile of W in registers and multiply it by a
``BLOCK_M`` row block of x (the weight crosses memory once, in 4 bits); from ``DEQUANT_ROWS``
the weight dequantized to x's dtype a chunk of output rows at a time, then cuBLAS (compute-bound
territory, where writing and rereading W costs little against the product).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanoserve.kernels.common import device_sm_count, interpreted
from nanoserve.kernels.int4_gemv import (
    TENSOR_CORE,
    Int4GemvConfig,
    check_int4_operands,
    dequantize_chunk,
    int4_gemv,
    load_chunk,
    nibble_values,
    select,
)

GEMV, DEQUANT = "gemv", "dequant"  # and TENSOR_CORE, the tuning tables' word for this kernel
DEQUANT_ROWS = 256  # where vLLM's AWQ dequantizes for cuBLAS too
DEQUANT_CHUNK_ELEMENTS = 1 << 26  # weights dequantized at once: 128 MB of scratch in 16 bits


def int4_path(rows: int, n: int, k: int, device: torch.device) -> str:
    """Which kernel multiplies ``rows`` rows by an ``n x k`` int4 weight on ``device``."""
    return _plan(rows, n, k, device)[0]


def _plan(rows: int, n: int, k: int, device: torch.device
          ) -> tuple[str, Int4GemvConfig | None]:
    """:func:`int4_path`'s answer and, for the GEMV, the tiles it was chosen with."""
    if rows >= DEQUANT_ROWS:
        return DEQUANT, None
    config = select(rows, n, k, device)
    return (GEMV if config is not None else TENSOR_CORE), config


@triton.jit
def _int4_gemm_kernel(x_ptr, w_ptr, sz_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.arange(0, BLOCK_K // 2)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # BLOCK_K divides GROUP: one scale per tile row
        byte = tl.load(w_ptr + rn[:, None] * (K // 2) + (k0 // 2 + half)[None, :],
                       mask=n_ok[:, None], other=0).to(tl.int32)
        group = (k0 // GROUP) * N + rn
        scale = tl.load(sz_ptr + group * 2, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        zero = tl.load(sz_ptr + group * 2 + 1, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        w_even = nibble_values(byte & 15) * scale + zero  # [BLOCK_N, BLOCK_K / 2]
        w_odd = nibble_values(byte >> 4) * scale + zero
        cols = k0 + 2 * half
        x_even = tl.load(x_ptr + rm[:, None] * stride_xm + cols[None, :], mask=m_ok[:, None],
                         other=0.0)
        x_odd = tl.load(x_ptr + rm[:, None] * stride_xm + cols[None, :] + 1,
                        mask=m_ok[:, None], other=0.0)
        acc += tl.dot(x_even, tl.trans(w_even.to(x_even.dtype)))
        acc += tl.dot(x_odd, tl.trans(w_odd.to(x_odd.dtype)))
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
              group_size: int) -> torch.Tensor:
    """The tensor-core path of :func:`int4_linear` (any row count; meant for 9 to 255)."""
    m, k = x.shape
    n = packed.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    small = interpreted(x.device)
    block_k = min(group_size, 32 if small else 128)
    # As few padded rows as tl.dot allows (16), up to 64.
    block_m = min(max(16, triton.next_power_of_2(m)), 32 if small else 64)
    block_n = 32 if small else 64
    # Few rows are a weight stream: narrower column blocks where 64 would leave SMs idle.
    if triton.cdiv(m, block_m) * triton.cdiv(n, block_n) < 2 * device_sm_count(x.device):
        block_n = 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](x, packed, scales_zeros, y, m, n, k, x.stride(0), y.stride(0),
                            GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y


@triton.jit
def _int4_dequant_kernel(w_ptr, sz_ptr, out_ptr, n_start, rows, N, K, stride_wn,
                         GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    r_ok = r < rows
    words, scale, zero = load_chunk(w_ptr, sz_ptr, n_start + r, r_ok, k0, N, K, stride_wn,
                                    GROUP, BLOCK_K, True)
    w = dequantize_chunk(words, scale, zero, BLOCK_N, BLOCK_K)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * K + k0 + tl.arange(0, BLOCK_K)[None, :],
             w.to(out_ptr.dtype.element_ty), mask=r_ok[:, None])


def dequantize_int4(packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int,
                    dtype: torch.dtype, start: int = 0, rows: int | None = None
                    ) -> torch.Tensor:
    """Output features ``start .. start + rows`` of the weight, ``[rows, K]`` in ``dtype``."""
    n, k = packed.shape[0], packed.shape[1] * 2
    rows = n - start if rows is None else rows
    out = torch.empty(rows, k, dtype=dtype, device=packed.device)
    words = packed.view(torch.int32)
    block_n, block_k = 16, min(256, k & -k)  # whole chunks of K: the lowest set bit of K
    _int4_dequant_kernel[(triton.cdiv(rows, block_n), k // block_k)](
        words, scales_zeros, out, start, rows, n, k, words.stride(0), GROUP=group_size,
        BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def int4_dequant_matmul(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
                        group_size: int) -> torch.Tensor:
    """The large-batch path of :func:`int4_linear`: W dequantized, then ``F.linear``."""
    n, k = packed.shape[0], x.shape[1]
    step = max(16, DEQUANT_CHUNK_ELEMENTS // k // 16 * 16)
    outs = [F.linear(x, dequantize_int4(packed, scales_zeros, group_size, x.dtype, start,
                                        min(step, n - start)))
            for start in range(0, n, step)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
                group_size: int, path: str | None = None) -> torch.Tensor:
    """``x`` ``[M, K]`` times the int4 weight ``packed`` ``[N, K / 2]`` (uint8) with
    ``scales_zeros`` ``[K / g, N, 2]``; the result ``[M, N]`` in ``x``'s dtype. ``path``: one
    of ``GEMV``, ``TENSOR_CORE``, ``DEQUANT`` (default: :func:`int4_path`'s)."""
    m, k = x.shape
    n = packed.shape[0]
    config = None
    if path is None:
        path, config = _plan(m, n, k, x.device)
    if path == GEMV:  # which checks its operands itself
        return int4_gemv(x, packed, scales_zeros, group_size, config)
    check_int4_operands(x, packed, scales_zeros, group_size)
    if m == 0:
        return x.new_empty(0, n)
    x = x.contiguous()
    if path == DEQUANT:
        return int4_dequant_matmul(x, packed, scales_zeros, group_size)
    if path != TENSOR_CORE:
        raise ValueError(f"unknown int4 path {path!r}")
    return int4_gemm(x, packed, scales_zeros, group_size)
