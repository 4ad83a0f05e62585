"""y = (x_q * s_x) (w_q * s_w)^T for FP8 weights with a scale a ``bn x bk`` block (the fp8
method of Qwen3-*-FP8 / DeepSeek checkpoints) and activations quantized per token and ``bk``
input features: each program sums ``BLOCK_M x BLOCK_N`` e4m3 tile products along K, one K
block (one scale of each side) at a time, on the tensor cores' fp8 path. The tiles are data:
:func:`select` (``configs/fp8_block_gemm/``)."""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanoserve.kernels.common import interpreted
from nanoserve.kernels.tuning import bucket, load_table, memoised, tuned

# Tuning-table buckets of rows: decode steps (16 or fewer: one block of rows) to prefill chunks.
ROW_BUCKETS = tuple(2 ** i for i in range(4, 13))  # 16 .. 4096
INTERPRETER_BLOCK_N = 32  # narrow tiles on the CPU: the tests' few features span programs


class Fp8BlockConfig(NamedTuple):
    """Tiles and launch options of one block-fp8 GEMM launch (:func:`fp8_block_linear`). K
    goes one scale block (``bk``) a step whatever the config."""

    block_m: int  # rows of x a program: a power of two, at least 16 (tl.dot's least)
    # Output features a program: a power of two, at least 16, whatever the scale blocks' ``bn``
    # (each feature reads its own block's scale).
    block_n: int
    num_warps: int = 4  # Triton's defaults, which the launch had before it was tunable
    num_stages: int = 3


def heuristic_config(rows: int, bn: int) -> Fp8BlockConfig:
    """The launch for a shape nobody tuned: 16 rows a block for decode steps, else 64, by a
    scale block's features, at most 128."""
    return Fp8BlockConfig(16 if rows <= 16 else 64, min(bn, 128))


def shape_key(n: int, k: int, block: tuple[int, int]) -> str:
    """A tuning table's key: the weight's ``[N, K]`` and its scale blocks ``bn x bk``. Its
    buckets are rows, :data:`ROW_BUCKETS`."""
    return f"{n}x{k},block={block[0]}x{block[1]}"


def from_table(table: dict, rows: int, n: int, k: int, block: tuple[int, int]
               ) -> Fp8BlockConfig:
    """:func:`select`'s rule over one tuning table (``{shape_key: {row bucket: entry}}``)."""
    return tuned(table, shape_key(n, k, block), bucket(rows, ROW_BUCKETS),
                 heuristic_config(rows, block[0]))


@memoised
def select(rows: int, n: int, k: int, block: tuple[int, int], device: torch.device
           ) -> Fp8BlockConfig:
    """The tiles for ``rows`` rows by an ``n x k`` weight in ``block`` scale blocks on
    ``device``: its tuning file's entry for the shape and row bucket, else the heuristic's."""
    if interpreted(device):
        return heuristic_config(rows, block[0])._replace(
            block_n=min(block[0], INTERPRETER_BLOCK_N))
    return from_table(load_table("fp8_block_gemm", device), rows, n, k, block)


# Tiles beside the block height that are worth timing: (block_n, num_warps, num_stages).
CANDIDATE_TILES = ((64, 4, 3), (128, 4, 3), (128, 8, 3), (128, 4, 4), (256, 8, 3))


def candidates(rows: int, n: int, block: tuple[int, int]) -> list[Fp8BlockConfig]:
    """Launches worth timing for one row bucket: the heuristic's, and blocks of the rows'
    power of two (16 to 128) and half it, by :data:`CANDIDATE_TILES` (none wider than the
    weight)."""
    tallest = max(16, min(128, triton.next_power_of_2(rows)))
    widest = max(16, triton.next_power_of_2(n))
    found = [heuristic_config(rows, block[0])] + [
        Fp8BlockConfig(block_m, min(block_n, widest), warps, stages)
        for block_m in sorted({max(16, tallest // 2), tallest})
        for block_n, warps, stages in CANDIDATE_TILES]
    return list(dict.fromkeys(found))


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
                     block: tuple[int, int], dtype: torch.dtype,
                     config: Fp8BlockConfig | None = None) -> torch.Tensor:
    """``q`` ``[M, K]`` e4m3 with ``sx`` ``[M, K / bk]``, times ``w`` ``[N, K]`` e4m3 with
    ``sw`` ``[N / bn, K / bk]`` (float32 scales); the result ``[M, N]`` in ``dtype``.
    ``config``: the launch (default: :func:`select`'s)."""
    m, k = q.shape
    n = w.shape[0]
    bn, bk = block
    config = config or select(m, n, k, (bn, bk), q.device)
    y = torch.empty(m, n, dtype=dtype, device=q.device)
    sx, sw = sx.contiguous(), sw.contiguous()
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n))
    _fp8_block_kernel[grid](q, sx, w, sw, y, m, n, k, q.stride(0), sx.stride(0), y.stride(0),
                            SCALE_ROWS=bn, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                            BLOCK_K=bk, num_warps=config.num_warps,
                            num_stages=config.num_stages)
    return y
