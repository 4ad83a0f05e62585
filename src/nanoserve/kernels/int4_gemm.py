"""y = x W^T with W held as 4-bit codes (two a byte, the even input feature in the low nibble)
and a scale and zero per group of input features: ``W = (q - 8) * scale + zero`` (AWQ, GPTQ
and GGUF's 4-bit types repacked at load, ``layers/quantization/packed.py``). Each program
dequantizes a ``BLOCK_N x BLOCK_K`` tile of W in registers and multiplies it on the tensor
cores: the weight crosses memory once, in 4 bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.common import interpreted


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
                       mask=n_ok[:, None], other=0)
        group = (k0 // GROUP) * N + rn
        scale = tl.load(sz_ptr + group * 2, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        zero = tl.load(sz_ptr + group * 2 + 1, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        w_even = ((byte & 15).to(tl.float32) - 8.0) * scale + zero  # [BLOCK_N, BLOCK_K / 2]
        w_odd = ((byte >> 4).to(tl.float32) - 8.0) * scale + zero
        cols = k0 + 2 * half
        x_even = tl.load(x_ptr + rm[:, None] * stride_xm + cols[None, :], mask=m_ok[:, None],
                         other=0.0)
        x_odd = tl.load(x_ptr + rm[:, None] * stride_xm + cols[None, :] + 1,
                        mask=m_ok[:, None], other=0.0)
        acc += tl.dot(x_even, tl.trans(w_even.to(x_even.dtype)))
        acc += tl.dot(x_odd, tl.trans(w_odd.to(x_odd.dtype)))
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """``x`` ``[M, K]`` times the int4 weight ``packed`` ``[N, K / 2]`` (uint8) with
    ``scales_zeros`` ``[K / g, N, 2]``; the result ``[M, N]`` in ``x``'s dtype."""
    m, k = x.shape
    n = packed.shape[0]
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_k = min(group_size, 32 if interpreted(x.device) else 128)
    block_m = 16 if m <= 16 else (32 if interpreted(x.device) else 64)
    block_n = 32 if interpreted(x.device) else 64
    if k % block_k:
        raise ValueError(f"int4 weights need input features ({k}) in whole groups of {block_k}")
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](x, packed, scales_zeros, y, m, n, k, x.stride(0), y.stride(0),
                            GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y
