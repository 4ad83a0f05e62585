"""y = x W^T for the few rows of a decode step (1 to ``MAX_ROWS``) with W held as int4, in
:class:`~nanoserve.layers.quantization.packed.Int4Matrix`'s layout: codes two a byte
``[N, K / 2]`` (the even input feature in the low nibble), ``scales_zeros`` ``[K / g, N, 2]``,
``W = (q - 8) * scale + zero``.

A decode projection is a weight stream. Each program reads ``BLOCK_N`` output features' codes
along K in chunks of int32 words (input features ``8j .. 8j + 7`` in nibble order, 16 bytes a
thread), turns each nibble into a float by bit operations alone (:func:`_term`), multiplies it
by x's matching column on the CUDA cores in fp32 and sums per group, where the scale and zero
apply once: ``scale * sum(x (q - 8)) + zero * sum(x)``. Where ``N / BLOCK_N`` programs cannot
fill the GPU, K is split across programs that add into an fp32 scratch (``split_k``). Tiles:
:func:`select` (the tuning file ``configs/int4_gemv/<device>.json``, else
:func:`heuristic_config`). Layout notes (checked in the sm_90 assembly): no int-to-float
conversions, 16-byte code loads, only x and the final sums pass through shared memory.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanoserve.kernels.common import device_sm_count, interpreted, programmatic_launch
from nanoserve.kernels.skinny_gemm import MAX_ROWS, row_bucket, shape_key
from nanoserve.kernels.tuning import load_table, memoised

# A tuning entry that leaves the row bucket to the tensor-core kernel (int4_gemm.py).
TENSOR_CORE = "tensor_core"


class Int4GemvConfig(NamedTuple):
    """Tile sizes and launch options of one int4 GEMV launch."""

    block_n: int
    block_k: int  # input features a chunk: a power of two, at least 8
    split_k: int = 1  # programs sharing one row block's K (their sums added in fp32)
    num_warps: int = 4
    num_stages: int = 1


INTERPRETER_CONFIG = Int4GemvConfig(block_n=8, block_k=64, num_warps=1)


def _pow2_divisor(k: int, at_most: int) -> int:
    """The largest power of two <= ``at_most`` dividing ``k`` (K comes in whole chunks: no
    masks along K, whose unknown bounds would stop the loads from being vectorized)."""
    size = 1 << (at_most.bit_length() - 1)
    while k % size:
        size //= 2
    return size


# Per row bucket: (BLOCK_N, the longest BLOCK_K). The product [rows, BLOCK_N, BLOCK_K / 8] is
# summed in registers: one row takes 16 KB of codes a chunk (as skinny_gemm's 16 KB of bf16) in
# about 128 registers a thread (sm_90, 4 warps, no spills), more rows take less.
HEURISTIC_TILES = {1: (8, 4096), 2: (8, 1024), 4: (16, 256), 8: (16, 128)}


def heuristic_config(rows: int, n: int, k: int, sms: int) -> Int4GemvConfig:
    """Tiles for a shape nobody tuned: :data:`HEURISTIC_TILES`' for the row bucket, K split
    where too few row blocks would be resident: one row's 16 KB chunks need a program an SM,
    more rows' 1-4 KB chunks about four (as many as fit beside each other's registers)."""
    bucket = row_bucket(rows)
    block_n, longest = HEURISTIC_TILES[bucket]
    block_k = max(8, _pow2_divisor(k, longest))
    programs = triton.cdiv(n, block_n)
    wanted = sms if bucket == 1 else 4 * sms
    split = 1
    if programs < wanted:
        split = min(k // block_k, triton.cdiv(max(wanted, 2 * sms), programs))
    return Int4GemvConfig(block_n, block_k, max(1, split))


@memoised
def select(rows: int, n: int, k: int, device: torch.device) -> Int4GemvConfig | None:
    """The tiles for ``rows`` rows by an ``n x k`` int4 weight, or None for the tensor-core
    kernel: the device's tuning file's where it has the shape and row bucket, else the
    heuristic's."""
    if not 0 < rows <= MAX_ROWS:
        return None
    if interpreted(device):
        return INTERPRETER_CONFIG
    return from_table(load_table("int4_gemv", device), rows, n, k, device_sm_count(device))


def from_table(table: dict, rows: int, n: int, k: int, sms: int) -> Int4GemvConfig | None:
    """:func:`select`'s rule over one tuning table (``{"NxK": {"bucket": entry}}``)."""
    entry = table.get(shape_key(n, k), {}).get(str(row_bucket(rows)))
    if entry is None:
        return heuristic_config(rows, n, k, sms)
    return None if entry == TENSOR_CORE else Int4GemvConfig(**entry)


@triton.jit
def nibble_values(codes):
    """int32 codes in 0..15 as float32 ``q - 8``, exactly: the code ORed into the mantissa of
    2^23 reads as 2^23 + q. An int-to-float conversion runs at an eighth of the FMA rate on
    recent GPUs and would bound the kernel rather than the memory."""
    return (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0


@triton.jit
def load_chunk(w_ptr, sz_ptr, n, n_ok, k0, N, K, stride_wn,
               GROUP: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """Rows ``n``'s codes for input features ``k0 .. k0 + BLOCK_K`` as int32 words
    ``[1, BLOCK_N, groups, words a group]`` and their groups' scales and zeros ``[1, BLOCK_N,
    groups, 1]`` in fp32 (rows not ``n_ok``: zeros). The leading unit dimension is x's rows:
    a product that broadcasts keeps the codes' layout (one that adds a dimension had Triton
    move the unpacked floats through shared memory, 8 bytes a weight)."""
    SPAN: tl.constexpr = min(GROUP, BLOCK_K)  # features of a group in a chunk
    GROUPS: tl.constexpr = BLOCK_K // SPAN
    WORDS: tl.constexpr = SPAN // 8
    gi = tl.arange(0, GROUPS)[None, None, :, None]
    word = k0 // 8 + gi * WORDS + tl.arange(0, WORDS)[None, None, None, :]
    rows = n[None, :, None, None]
    w_mask = n_ok[None, :, None, None]
    g_mask = n_ok[None, :, None, None]
    if not EVEN_K:
        w_mask = w_mask & (word < K // 8)
        g_mask = g_mask & (k0 + gi * SPAN < K)
    sz = sz_ptr + ((k0 // GROUP + gi) * N + rows) * 2
    scale = tl.load(sz, mask=g_mask, other=0.0).to(tl.float32)
    zero = tl.load(sz + 1, mask=g_mask, other=0.0).to(tl.float32)
    # Loaded last: Triton gives the values the layout of the load it reaches them from last,
    # and the codes' (16 bytes a thread) is the one to keep. Codes are read once a step:
    # their lines leave the caches first, x's stay.
    words = tl.load(w_ptr + rows.to(tl.int64) * stride_wn + word, mask=w_mask, other=0,
                    eviction_policy="evict_first")
    return words, scale, zero


@triton.jit
def dequantize_chunk(words, scale, zero, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """:func:`load_chunk`'s chunk as the float32 weights ``[BLOCK_N, BLOCK_K]`` (for a store:
    the reshape goes through shared memory, which outruns the memory the store writes)."""
    codes = (words[:, :, :, :, None] >> (4 * tl.arange(0, 8))[None, None, None, None, :]) & 15
    w = nibble_values(codes) * scale[:, :, :, :, None] + zero[:, :, :, :, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def _term(x, half, J: tl.constexpr):
    """x ``[BLOCK_M, 1, groups, words]`` times ``q - 8`` for the codes in bits ``4J .. 4J + 3``
    of ``half``, broadcast to ``[BLOCK_M, BLOCK_N, groups, words]``. The code is ORed into
    2^23's mantissa where it lies, reading as ``2^23 + q * 16^J`` (no shift, no conversion);
    ``16^J`` comes off x, exactly, as x is shared by the BLOCK_N rows."""
    SCALE: tl.constexpr = 1 << (4 * J)
    bits = (half & (15 << (4 * J))) | 0x4B000000
    codes = bits.to(tl.float32, bitcast=True) - (8388608.0 + 8.0 * SCALE)
    return (x.to(tl.float32) * (1.0 / SCALE)) * codes


@triton.jit
def _int4_gemv_kernel(x_ptr, w_ptr, sz_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                      chunks_per_split,
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ATOMIC: tl.constexpr,
                      PDL: tl.constexpr):
    if PDL:  # the next kernel may start early; this one waits before reading x
        gdc_launch_dependents()
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    first = pid_k * chunks_per_split * BLOCK_K
    stop = tl.minimum(first + chunks_per_split * BLOCK_K, K)
    SPAN: tl.constexpr = min(GROUP, BLOCK_K)
    GROUPS: tl.constexpr = BLOCK_K // SPAN
    # x's column of nibble 0 of each word of the chunk, as load_chunk lays the words out.
    cols = tl.arange(0, GROUPS)[None, None, :, None] * SPAN \
        + 8 * tl.arange(0, SPAN // 8)[None, None, None, :]
    x_rows = x_ptr + m[:, None, None, None] * stride_xm + cols
    if PDL:
        gdc_wait()
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(first, stop, BLOCK_K):
        if EVEN_K:
            x_mask = m_ok[:, None, None, None]
        else:
            x_mask = m_ok[:, None, None, None] & (k0 + cols < K)
        # x's columns of each nibble position first, the codes last (see load_chunk).
        x0 = tl.load(x_rows + k0, mask=x_mask, other=0.0)
        x1 = tl.load(x_rows + k0 + 1, mask=x_mask, other=0.0)
        x2 = tl.load(x_rows + k0 + 2, mask=x_mask, other=0.0)
        x3 = tl.load(x_rows + k0 + 3, mask=x_mask, other=0.0)
        x4 = tl.load(x_rows + k0 + 4, mask=x_mask, other=0.0)
        x5 = tl.load(x_rows + k0 + 5, mask=x_mask, other=0.0)
        x6 = tl.load(x_rows + k0 + 6, mask=x_mask, other=0.0)
        x7 = tl.load(x_rows + k0 + 7, mask=x_mask, other=0.0)
        words, scale, zero = load_chunk(w_ptr, sz_ptr, n, n_ok, k0, N, K, stride_wn, GROUP,
                                        BLOCK_K, EVEN_K)
        high = words >> 16  # codes 4..7 where codes 0..3 lie
        part = _term(x0, words, 0) + _term(x1, words, 1) + _term(x2, words, 2) \
            + _term(x3, words, 3) + _term(x4, high, 0) + _term(x5, high, 1) \
            + _term(x6, high, 2) + _term(x7, high, 3)
        x_sum = (x0.to(tl.float32) + x1.to(tl.float32) + x2.to(tl.float32) + x3.to(tl.float32)
                 + x4.to(tl.float32) + x5.to(tl.float32) + x6.to(tl.float32)
                 + x7.to(tl.float32))
        # Per group: scale * sum(x (q - 8)) + zero * sum(x). (A sum over a unit axis puts
        # scale and zero in the reduced layout.)
        groups = tl.sum(part, axis=3) * tl.sum(scale, axis=3) \
            + tl.sum(x_sum, axis=3) * tl.sum(zero, axis=3)
        acc += tl.sum(groups, axis=2)
    out = y_ptr + m[:, None] * stride_ym + n[None, :]
    out_mask = m_ok[:, None] & n_ok[None, :]
    if ATOMIC:  # one of several K slices: y is the fp32 scratch
        tl.atomic_add(out, acc, mask=out_mask, sem="relaxed")
    else:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


def check_int4_operands(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
                        group_size: int) -> None:
    """Raise unless ``x`` ``[M, K]``, ``packed`` ``[N, K / 2]`` uint8 and ``scales_zeros``
    ``[K / g, N, 2]`` fit together, with ``g`` a power of two of at least 8 dividing K."""
    k, n = x.shape[1], packed.shape[0]
    if group_size < 8 or group_size & (group_size - 1) or k % group_size:
        raise ValueError(f"int4 weights need groups of a power of two >= 8 dividing the input "
                         f"features; got {group_size} for {k}")
    if packed.dtype != torch.uint8 or packed.shape != (n, k // 2) or not packed.is_contiguous():
        raise ValueError(f"packed must be contiguous uint8 [N, {k // 2}], got "
                         f"{tuple(packed.shape)} {packed.dtype}")
    if scales_zeros.shape != (k // group_size, n, 2) or not scales_zeros.is_contiguous():
        raise ValueError(f"scales_zeros must be contiguous [{k // group_size}, {n}, 2], got "
                         f"{tuple(scales_zeros.shape)}")


def int4_gemv(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
              group_size: int, config: Int4GemvConfig | None = None) -> torch.Tensor:
    """``x`` ``[M, K]`` (M <= ``MAX_ROWS``) times the int4 weight; the result ``[M, N]`` in
    ``x``'s dtype. ``config``: the tiles (default: :func:`select`'s)."""
    m, k = x.shape
    n = packed.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"int4_gemv serves at most {MAX_ROWS} rows, got {m}")
    check_int4_operands(x, packed, scales_zeros, group_size)
    if m == 0:
        return x.new_empty(0, n)
    x = x if x.stride(1) == 1 else x.contiguous()
    cfg = config or select(m, n, k, x.device) or heuristic_config(
        m, n, k, device_sm_count(x.device))
    block_k = max(8, min(cfg.block_k, triton.next_power_of_2(k)))
    chunks = triton.cdiv(k, block_k)
    per_split = triton.cdiv(chunks, max(1, cfg.split_k))
    splits = triton.cdiv(chunks, per_split)
    # Split K: the slices' sums meet in fp32 (zeros from the caching allocator: graph-safe).
    y = torch.zeros(m, n, dtype=torch.float32, device=x.device) if splits > 1 else \
        torch.empty(m, n, dtype=x.dtype, device=x.device)
    words = packed.view(torch.int32)  # 8 codes a word, input features in nibble order
    pdl = programmatic_launch(x.device)
    _int4_gemv_kernel[(triton.cdiv(n, cfg.block_n), splits)](
        x, words, scales_zeros, y, m, n, k, x.stride(0), words.stride(0), y.stride(0),
        per_split, GROUP=group_size, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=cfg.block_n,
        BLOCK_K=block_k, EVEN_K=k % block_k == 0, ATOMIC=splits > 1, PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl)
    return y.to(x.dtype)
