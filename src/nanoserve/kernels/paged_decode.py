"""Paged decode attention (one query token per sequence) as a persistent, stream-K kernel.

The work of a decode step is a list of tiles: for each sequence, for each KV head (a "row"),
``cdiv(seq_len, BLOCK_N)`` tiles of ``BLOCK_N`` keys. A small plan kernel writes that list once
per step (every layer reuses it); a fixed grid of programs then splits it into equal contiguous
ranges, so every program streams the same number of K/V bytes however ragged the contexts are,
and its software pipeline runs on across row boundaries. Each program attends the whole query
group of a row's KV head (each K/V tile is read once per group). A row that lies inside one
program's range is written out directly; a row cut by range boundaries leaves fp32 partial
results (running max, sum of exponentials, unnormalised accumulator) in two slots per program,
which a merge kernel combines.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from nanoserve.kernels.common import (LOG2E, check_attention_inputs, dot_precision, interpreted,
                                      programmatic_launch)

# Tile entries pack (row << TILE_BITS) | tile into int32.
TILE_BITS = 15
MAX_ROWS = 1 << (31 - TILE_BITS)
# Under TRITON_INTERPRET the "device" is the CPU; small tiles and a few programs make short
# test sequences span several tiles and program ranges.
INTERPRETER_BLOCK_N = 16
INTERPRETER_SMS = 4


class DecodeTuning(NamedTuple):
    """Launch options of the attention kernel (see docs/kernels.md for the sweep behind them)."""

    block_n: int = 64  # keys per tile
    num_warps: int = 4
    num_stages: int = 5
    programs_per_sm: int = 2  # persistent programs


class DecodePlan(NamedTuple):
    """One step's tile list, shared by every layer's decode attention.

    ``tiles[0]`` is the number of tiles; ``tiles[1 + t]`` packs tile ``t``'s row (sequence x
    KV heads + KV head) and its index within the row. ``seq_base[s]`` is the first tile of
    sequence ``s``'s rows.
    """

    tiles: torch.Tensor
    seq_base: torch.Tensor
    block_n: int


@triton.jit
def _plan_kernel(seq_lens_ptr, tiles_ptr, seq_base_ptr, num_seqs, num_kv_heads,
                 BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
                 TILE_SHIFT: tl.constexpr):
    seq = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    lens = tl.load(seq_lens_ptr + s, mask=s < num_seqs, other=0)
    row_tiles = (lens + BLOCK_N - 1) // BLOCK_N
    n = tl.sum(tl.where(s == seq, row_tiles, 0), 0)
    base = (tl.sum(tl.where(s < seq, row_tiles, 0), 0)) * num_kv_heads
    if seq == 0:
        tl.store(tiles_ptr, tl.sum(row_tiles, 0) * num_kv_heads)
    tl.store(seq_base_ptr + seq, base)
    count = n * num_kv_heads
    for start in range(0, count, CHUNK):
        i = start + tl.arange(0, CHUNK)
        safe_n = tl.maximum(n, 1)
        entry = ((seq * num_kv_heads + i // safe_n) << TILE_SHIFT) | (i % safe_n)
        tl.store(tiles_ptr + 1 + base + i, entry, mask=i < count)


@triton.jit
def _attend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    tiles_ptr, out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr,
    scale_log2, num_kv_heads,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    TILE_SHIFT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    total = tl.load(tiles_ptr)
    per = tl.cdiv(total, NUM_PROGRAMS)
    t0 = pid * per
    t1 = tl.minimum(t0 + per, total)
    tile_mask = (1 << TILE_SHIFT) - 1

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    out_mask = g_mask[:, None] & d_mask[None, :]

    first_row = tl.load(tiles_ptr + 1 + t0, mask=t0 < t1, other=0) >> TILE_SHIFT
    row = first_row
    row_start = tl.load(tiles_ptr + 1 + t0, mask=t0 < t1, other=0) & tile_mask
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for t in range(t0, t1):
        entry = tl.load(tiles_ptr + 1 + t)
        tile_row = entry >> TILE_SHIFT
        if tile_row != row:
            # A row only changes where it ends, so the finished row is whole iff it began here.
            _write_row(row, row_start == 0, 2 * pid + (row != first_row).to(tl.int32),
                       m_i, l_i, acc, query_start_loc_ptr, out_ptr, part_max_ptr, part_sum_ptr,
                       part_acc_ptr, num_kv_heads, stride_ot, stride_oh, g, d, g_mask, out_mask,
                       GROUP, HEAD_DIM)
            m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
            row = tile_row
            row_start = entry & tile_mask
        seq = tile_row // num_kv_heads
        kv_head = tile_row % num_kv_heads
        seq_len = tl.load(seq_lens_ptr + seq)
        token = tl.load(query_start_loc_ptr + seq)
        q = tl.load(q_ptr + token * stride_qt + (kv_head * GROUP + g)[:, None] * stride_qh
                    + d[None, :], mask=out_mask, other=0.0)
        pos = (entry & tile_mask) * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = pos < seq_len
        block = tl.load(block_tables_ptr + seq.to(tl.int64) * stride_bt + pos // BLOCK_SIZE,
                        mask=valid, other=0).to(tl.int64)
        offset = pos % BLOCK_SIZE
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + (block * stride_kb + offset * stride_ks + kv_head * stride_kh)[:, None]
                    + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + (block * stride_vb + offset * stride_vs + kv_head * stride_vh)[:, None]
                    + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        # Every tile holds at least one valid key, so m_new is finite and exp2 never sees inf-inf.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if t0 < t1:
        # The last row is whole iff it began here and the next tile (if any) starts another row.
        next_row = tl.load(tiles_ptr + 1 + t1, mask=t1 < total, other=-1) >> TILE_SHIFT
        whole = (row_start == 0) & ((t1 == total) | (next_row != row))
        _write_row(row, whole, 2 * pid + (row != first_row).to(tl.int32),
                   m_i, l_i, acc, query_start_loc_ptr, out_ptr, part_max_ptr, part_sum_ptr,
                   part_acc_ptr, num_kv_heads, stride_ot, stride_oh, g, d, g_mask, out_mask,
                   GROUP, HEAD_DIM)


@triton.jit
def _write_row(row, whole, slot, m_i, l_i, acc, query_start_loc_ptr, out_ptr, part_max_ptr,
               part_sum_ptr, part_acc_ptr, num_kv_heads, stride_ot, stride_oh, g, d, g_mask,
               out_mask, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Store a finished row: normalised output when whole, else a partial result in ``slot``."""
    seq = row // num_kv_heads
    head = (row % num_kv_heads) * GROUP + g
    token = tl.load(query_start_loc_ptr + seq)
    whole_g = tl.broadcast_to(whole.to(tl.int32), g.shape) != 0
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + token * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=out_mask & whole_g[:, None])
    part = slot * GROUP + g
    tl.store(part_max_ptr + part, m_i, mask=g_mask & ~whole_g)
    tl.store(part_sum_ptr + part, l_i, mask=g_mask & ~whole_g)
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc,
             mask=out_mask & ~whole_g[:, None])


@triton.jit
def _merge_kernel(
    tiles_ptr, seq_base_ptr, seq_lens_ptr, query_start_loc_ptr,
    part_max_ptr, part_sum_ptr, part_acc_ptr, out_ptr,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_PROGRAMS: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # o_proj's batch-1 GEMV may start fetching its weights
        gdc_launch_dependents()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    g = head % GROUP
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    n = tl.cdiv(tl.load(seq_lens_ptr + seq), BLOCK_N)
    per = tl.maximum(tl.cdiv(tl.load(tiles_ptr), NUM_PROGRAMS), 1)
    first = tl.load(seq_base_ptr + seq) + kv_head * n
    p_first = first // per
    p_last = (first + tl.maximum(n, 1) - 1) // per
    out_ptrs = out_ptr + tl.load(query_start_loc_ptr + seq) * stride_ot + head * stride_oh + d
    if n == 0:  # padding sequences have no keys: zeros, not NaN
        tl.store(out_ptrs, tl.zeros([BLOCK_D], tl.float32).to(out_ptr.dtype.element_ty),
                 mask=d_mask)
    elif p_first != p_last:  # otherwise the attention kernel wrote this row
        m_run = tl.full([], float("-inf"), tl.float32)
        l_run = tl.full([], 0.0, tl.float32)
        acc_run = tl.zeros([BLOCK_D], tl.float32)
        for p0 in range(p_first, p_last + 1, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            p_mask = p <= p_last
            # The row holds program p's first tile except perhaps in the first program.
            slot = 2 * p + ((p == p_first) & (first != p_first * per)).to(tl.int32)
            part = slot * GROUP + g
            m = tl.load(part_max_ptr + part, mask=p_mask, other=float("-inf"))
            l = tl.load(part_sum_ptr + part, mask=p_mask, other=0.0)
            a = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :],
                        mask=p_mask[:, None] & d_mask[None, :], other=0.0)
            m_new = tl.maximum(m_run, tl.max(m, 0))
            w = tl.exp2(m - m_new)
            rescale = tl.exp2(m_run - m_new)
            l_run = l_run * rescale + tl.sum(l * w, 0)
            acc_run = acc_run * rescale + tl.sum(a * w[:, None], 0)
            m_run = m_new
        tl.store(out_ptrs, (acc_run / l_run).to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.cache
def device_sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (a nominal few under the CPU interpreter), cached per device."""
    if interpreted(device):
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_decode(seq_lens: torch.Tensor, num_kv_heads: int, max_context: int,
                block_n: int = DecodeTuning().block_n) -> DecodePlan:
    """Write the tile list of a decode step on the device (one launch, no host sync).

    ``max_context`` bounds every ``seq_lens`` entry (e.g. the block-table width x block size);
    it only sizes the buffer, so a CUDA graph captured with it stays valid for any lengths.
    """
    device = seq_lens.device
    if interpreted(device):
        block_n = INTERPRETER_BLOCK_N
    num_seqs = seq_lens.shape[0]
    row_tiles = triton.cdiv(max_context, block_n)
    if num_seqs * num_kv_heads > MAX_ROWS or row_tiles >= 1 << TILE_BITS:
        raise ValueError(f"decode plan too large: {num_seqs} sequences x {num_kv_heads} KV heads, "
                         f"contexts up to {max_context} keys")
    tiles = torch.empty(1 + num_seqs * num_kv_heads * row_tiles, dtype=torch.int32, device=device)
    seq_base = torch.empty(num_seqs, dtype=torch.int32, device=device)
    if num_seqs == 0:
        tiles[0] = 0
        return DecodePlan(tiles, seq_base, block_n)
    _plan_kernel[(num_seqs,)](seq_lens, tiles, seq_base, num_seqs, num_kv_heads,
                              BLOCK_S=triton.next_power_of_2(num_seqs), BLOCK_N=block_n,
                              CHUNK=1024, TILE_SHIFT=TILE_BITS)
    return DecodePlan(tiles, seq_base, block_n)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     query_start_loc: torch.Tensor, scale: float,
                     plan: DecodePlan | None = None,
                     tuning: DecodeTuning = DecodeTuning()) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context; returns ``[T, H, D]``.

    ``q`` is ``[T, H, D]`` with sequence ``i``'s token at row ``query_start_loc[i]``; the keys
    are the first ``seq_lens[i]`` cache entries read through ``block_tables[i]``. ``plan``
    (from :func:`plan_decode`, shared by a step's layers) is made here when not given; its tile
    size overrides ``tuning.block_n``. Launch shapes depend on Python ints alone, so the call is
    CUDA-graph capturable.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    check_attention_inputs(q, k_cache, v_cache)
    device = q.device
    if plan is None:
        plan = plan_decode(seq_lens, num_kv_heads, block_tables.shape[1] * block_size,
                           tuning.block_n)
    group = num_heads // num_kv_heads
    block_d = max(triton.next_power_of_2(head_dim), 16)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=device)
    if num_seqs == 0:
        return out
    programs = tuning.programs_per_sm * device_sm_count(device)
    part_max = torch.empty((2 * programs, group), dtype=torch.float32, device=device)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty((2 * programs, group, head_dim), dtype=torch.float32, device=device)
    _attend_kernel[(programs,)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        plan.tiles, out, part_max, part_sum, part_acc,
        scale * LOG2E, num_kv_heads,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=max(triton.next_power_of_2(group), 16),
        HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_N=plan.block_n, NUM_PROGRAMS=programs,
        TILE_SHIFT=TILE_BITS, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=tuning.num_warps, num_stages=tuning.num_stages,
    )
    _merge_kernel[(num_seqs, num_heads)](
        plan.tiles, plan.seq_base, seq_lens, query_start_loc,
        part_max, part_sum, part_acc, out,
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_N=plan.block_n, NUM_PROGRAMS=programs, BLOCK_P=16,
        PDL=programmatic_launch(device), num_warps=4,
    )
    return out
