"""y = (x_q * s_x) (w_q * s_w)^T for FP8 weights with a scale a ``bn x bk`` block (the fp8
method of Qwen3-*-FP8 / DeepSeek checkpoints) and activations quantized per token and ``bk``
input features: each program sums ``BLOCK_M x BLOCK_N`` e4m3 tile products along K, one K
block (one scale of each side) at a time, on the tensor cores' fp8 path."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.common import interpreted


@triton.jit
def _fp8_block_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, y_ptr, M, N, K, stride_xm, stride_sxm,
                      stride_ym, SCALE_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    k_blocks = K // BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, k_blocks):
        cols = kb * BLOCK_K + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + cols[None, :], mask=m_ok[:, None],
                    other=0.0)
        w = tl.load(w_ptr + rn[:, None] * K + cols[None, :], mask=n_ok[:, None], other=0.0)
        part = tl.dot(x, tl.trans(w))
        sx = tl.load(sx_ptr + rm * stride_sxm + kb, mask=m_ok, other=0.0)
        sw = tl.load(sw_ptr + (rn // SCALE_ROWS) * k_blocks + kb, mask=n_ok, other=0.0)
        acc += part * sx[:, None] * sw[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def fp8_block_linear(q: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
                     block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """``q`` ``[M, K]`` e4m3 with ``sx`` ``[M, K / bk]``, times ``w`` ``[N, K]`` e4m3 with
    ``sw`` ``[N / bn, K / bk]`` (float32 scales); the result ``[M, N]`` in ``dtype``."""
    m, k = q.shape
    n = w.shape[0]
    bn, bk = block
    y = torch.empty(m, n, dtype=dtype, device=q.device)
    block_m = 16 if m <= 16 else 64
    block_n = min(bn, 32 if interpreted(q.device) else 128)
    sx, sw = sx.contiguous(), sw.contiguous()
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_block_kernel[grid](q, sx, w, sw, y, m, n, k, q.stride(0), sx.stride(0), y.stride(0),
                            SCALE_ROWS=bn, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk)
    return y
