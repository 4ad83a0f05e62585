"""y = x W^T with W held as 4-bit codes (two a byte, the even input feature in the low nibble)
and a scale and zero per group of input features: ``W = (q - 8) * scale + zero`` (AWQ, GPTQ
and GGUF's 4-bit types repacked at load, ``layers/quantization/packed.py``).

:func:`int4_linear` picks the path by rows (:func:`int4_path`): up to 8 the skinny GEMV
(``int4_gemv.py``), which streams the codes on the CUDA cores; then the tensor-core kernel here,
whose programs turn a group of W's codes into 16-bit floats in registers and multiply a
``BLOCK_M`` row block of x by them (the weight crosses memory once, in 4 bits); from
``DEQUANT_ROWS`` the weight dequantized to x's dtype a chunk of output rows at a time, then cuBLAS (compute-bound
territory, where writing and rereading W costs little against the product). The tensor-core
kernel's tiles are data: :func:`select` (``configs/int4_gemm/``).
"""
from __future__ import annotations

from typing import NamedTuple

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
)
from nanoserve.kernels.int4_gemv import select as select_gemv
from nanoserve.kernels.tuning import bucket, load_table, memoised, tuned

GEMV, DEQUANT = "gemv", "dequant"  # and TENSOR_CORE, the tuning tables' word for this kernel
DEQUANT_ROWS = 256  # where vLLM's AWQ dequantizes for cuBLAS too
DEQUANT_CHUNK_ELEMENTS = 1 << 26  # weights dequantized at once: 128 MB of scratch in 16 bits
# Tuning-table buckets of rows: those the tensor-core kernel serves, 9 to 255.
ROW_BUCKETS = (16, 32, 64, 128, 256)
INTERPRETER_BLOCK_N = 32  # narrow tiles on the CPU: the tests' few features span programs


class Int4GemmConfig(NamedTuple):
    """Tiles and launch options of one tensor-core int4 GEMM launch (:func:`int4_gemm`)."""

    block_m: int  # rows of x a program: a power of two, at least 16 (tl.dot's least)
    block_n: int  # output features a program: a power of two, at least 16
    split_k: int = 1  # K slices wanted (whole groups each, at most the groups), summed in fp32
    num_warps: int = 4
    num_stages: int = 3


def heuristic_config(rows: int, n: int, k: int, group_size: int, sms: int,
                     block_n: int = 128) -> Int4GemmConfig:
    """The launch for a shape nobody tuned: blocks of 16 to 64 rows by ``block_n`` features
    (the interpreter's are fewer), K split in up to 4 where fewer programs than two an SM
    would run."""
    block_m = min(max(16, triton.next_power_of_2(rows)), 64)
    programs = triton.cdiv(rows, block_m) * triton.cdiv(n, block_n)
    return Int4GemmConfig(block_m, block_n,
                          min(4, k // group_size, triton.cdiv(2 * sms, programs)))


def shape_key(n: int, k: int, group_size: int) -> str:
    """A tuning table's key: the weight's ``[N, K]`` and its group, the kernel's step along K
    (and the split's unit). Its buckets are rows, :data:`ROW_BUCKETS`."""
    return f"{n}x{k},group={group_size}"


def from_table(table: dict, rows: int, n: int, k: int, group_size: int, sms: int
               ) -> Int4GemmConfig:
    """:func:`select`'s rule over one tuning table (``{shape_key: {row bucket: entry}}``)."""
    return tuned(table, shape_key(n, k, group_size), bucket(rows, ROW_BUCKETS),
                 heuristic_config(rows, n, k, group_size, sms))


@memoised
def select(rows: int, n: int, k: int, group_size: int, device: torch.device) -> Int4GemmConfig:
    """The tiles for ``rows`` rows by an ``n x k`` int4 weight on the tensor cores: the
    device's tuning file's entry for the shape and row bucket, else the heuristic's."""
    sms = device_sm_count(device)
    if interpreted(device):
        return heuristic_config(rows, n, k, group_size, sms, INTERPRETER_BLOCK_N)._replace(
            num_warps=1, num_stages=1)
    return from_table(load_table("int4_gemm", device), rows, n, k, group_size, sms)


def candidates(rows: int, n: int, k: int, group_size: int, sms: int) -> list[Int4GemmConfig]:
    """Launches worth timing for one row bucket: the heuristic's, and its block height (and
    128 rows past 64: W read half as often) by 64 or 128 features (none wider than the
    weight), its split count and one other, two pipeline depths; 8 warps for 128 x 128
    tiles, whose accumulator would not fit 4 warps' registers."""
    base = heuristic_config(rows, n, k, group_size, sms)
    heights = (base.block_m, 128) if rows > 64 else (base.block_m,)
    splits = (base.split_k, 1 if base.split_k > 1 else min(2, k // group_size))
    widths = sorted({min(block_n, max(16, triton.next_power_of_2(n))) for block_n in (64, 128)})
    found = [base] + [
        Int4GemmConfig(block_m, block_n, split, 8 if block_m * block_n >= 128 * 128 else 4,
                       stages)
        for block_m in heights for block_n in widths for split in splits for stages in (2, 3)]
    return list(dict.fromkeys(found))


def int4_path(rows: int, n: int, k: int, device: torch.device) -> str:
    """Which kernel multiplies ``rows`` rows by an ``n x k`` int4 weight on ``device``."""
    return _plan(rows, n, k, device)[0]


def _plan(rows: int, n: int, k: int, device: torch.device
          ) -> tuple[str, Int4GemvConfig | None]:
    """:func:`int4_path`'s answer and, for the GEMV, the tiles it was chosen with."""
    if rows >= DEQUANT_ROWS:
        return DEQUANT, None
    config = select_gemv(rows, n, k, device)
    return (GEMV if config is not None else TENSOR_CORE), config


@triton.jit
def _int4_gemm_kernel(x_ptr, w_ptr, sz_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                      groups_per_split, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, ATOMIC: tl.constexpr, SHIFTED: tl.constexpr):
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok, m_ok = n < N, m < M
    WORDS: tl.constexpr = GROUP // 8
    words_of = w_ptr + n.to(tl.int64)[:, None] * stride_wn + tl.arange(0, WORDS)[None, :]
    # x's column of nibble 0 of each word of a group.
    x_cols = x_ptr + m[:, None] * stride_xm + 8 * tl.arange(0, WORDS)[None, :]
    first = pid_k * groups_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(first, tl.minimum(first + groups_per_split, K // GROUP)):
        words = tl.load(words_of + g * WORDS, mask=n_ok[:, None], other=0,
                        eviction_policy="evict_first")  # [BLOCK_N, WORDS]
        dot = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        x_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for j in tl.static_range(4):
            # Codes j and j + 4 of each word ORed into the mantissas of two bf16 128.0s: each
            # half, as a float32's top half, reads as 128 + q exactly. 16-bit x (SHIFTED) takes
            # it as it is, the product's offset taken off after by 136 * sum(x) (the fp32 sums
            # lose about 4 of their 24 bits to it); fp32 x, exact, takes q - 8.
            pair = ((words >> (4 * j)) & 0x000F000F) | 0x43004300
            low = (pair << 16).to(tl.float32, bitcast=True)
            high = (pair & -65536).to(tl.float32, bitcast=True)
            if SHIFTED:
                low, high = low.to(x_ptr.dtype.element_ty), high.to(x_ptr.dtype.element_ty)
            else:
                low, high = low - 136.0, high - 136.0
            x_low = tl.load(x_cols + g * GROUP + j, mask=m_ok[:, None], other=0.0)
            x_high = tl.load(x_cols + g * GROUP + j + 4, mask=m_ok[:, None], other=0.0)
            dot = tl.dot(x_low, tl.trans(low), dot)
            dot = tl.dot(x_high, tl.trans(high), dot)
            x_sum += tl.sum(x_low.to(tl.float32), axis=1) + tl.sum(x_high.to(tl.float32), axis=1)
        sz = sz_ptr + (g * N + n) * 2
        scale = tl.load(sz, mask=n_ok, other=0.0).to(tl.float32)
        zero = tl.load(sz + 1, mask=n_ok, other=0.0).to(tl.float32)
        # Per group: scale * sum(x (q - 8)) + zero * sum(x).
        if SHIFTED:
            dot -= 136.0 * x_sum[:, None]
        acc += dot * scale[None, :] + x_sum[:, None] * zero[None, :]
    out = y_ptr + m[:, None] * stride_ym + n[None, :]
    if ATOMIC:  # one of several K slices: y is the fp32 scratch
        tl.atomic_add(out, acc, mask=m_ok[:, None] & n_ok[None, :], sem="relaxed")
    else:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
              group_size: int, config: Int4GemmConfig | None = None) -> torch.Tensor:
    """The tensor-core path of :func:`int4_linear` (any row count; meant for 9 to 255): one
    group of K a step, ``config``'s tiles (default: :func:`select`'s), K split in whole groups
    (the slices as even as the groups allow, so maybe fewer than ``config.split_k``)."""
    m, k = x.shape
    n = packed.shape[0]
    config = config or select(m, n, k, group_size, x.device)
    block_m, block_n = config.block_m, config.block_n
    groups = k // group_size
    per_split = triton.cdiv(groups, min(config.split_k, groups))
    splits = triton.cdiv(groups, per_split)
    # Split K: the slices' sums meet in fp32 (zeros from the caching allocator: graph-safe).
    y = torch.zeros(m, n, dtype=torch.float32, device=x.device) if splits > 1 else \
        torch.empty(m, n, dtype=x.dtype, device=x.device)
    words = packed.view(torch.int32)
    _int4_gemm_kernel[(triton.cdiv(n, block_n), splits, triton.cdiv(m, block_m))](
        x, words, scales_zeros, y, m, n, k, x.stride(0), words.stride(0), y.stride(0),
        per_split, GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n, ATOMIC=splits > 1,
        SHIFTED=x.element_size() == 2, num_warps=config.num_warps,
        num_stages=config.num_stages)
    return y.to(x.dtype)


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
