"""Device code of paged decode attention (``decode_attention.py``): split and merge kernels."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanoserve.kernels.common import online_softmax_step, soft_cap
from nanoserve.kernels.qk_norm_rope import norm_rope_rows


# The block table's width follows the step's longest context: specialising on it would recompile.
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    seq_order_ptr, out_ptr, part_lse_ptr, part_o_ptr, sinks_ptr,
    k_new_ptr, v_new_ptr, positions_ptr, slot_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr,
    scale_log2, eps, window, softcap_log2,
    num_heads,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt, stride_btc,
    stride_ot, stride_oh,
    stride_knt, stride_knh, stride_vnt, stride_vnh, stride_cs,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, HEADS_FIRST: tl.constexpr,
    ORDERED: tl.constexpr, PDL: tl.constexpr,
    NEW_TOKENS: tl.constexpr, HAS_QK_NORM: tl.constexpr, NARROW_OFFSETS: tl.constexpr,
    FP16_PRODUCTS: tl.constexpr, PREFETCH_KV: tl.constexpr, SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    if PDL:  # with one split, o_proj's batch-1 GEMV may start fetching its weights
        gdc_launch_dependents()
    # Heads first: a sequence's KV heads are neighbouring programs, reading neighbouring bytes.
    if HEADS_FIRST:
        kv_head = tl.program_id(0)
        rank = tl.program_id(1)
    else:
        rank = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Programs start in grid order: longest first keeps a long context from running alone last.
    if ORDERED:
        seq = tl.load(seq_order_ptr + rank)
    else:
        seq = rank

    # The slice comes from the on-device length, so a captured graph suits any context length.
    # Lengths and query rows are step inputs (written before the forward): read before waiting.
    seq_len = tl.load(seq_lens_ptr + seq)
    # A sliding window (window > 0) sees the last `window` keys: the splits share only those.
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len - lo, BLOCK_N), NUM_SPLITS)
    start = lo + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    head = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    token = tl.load(query_start_loc_ptr + seq)
    q_rows = q_ptr + token * stride_qt + head[:, None] * stride_qh
    q_mask = g_mask[:, None] & d_mask[None, :]
    if NEW_TOKENS:
        # RoPE's tables and the norm weights are step inputs and parameters: read before waiting.
        half = HEAD_DIM // 2
        partner = tl.where(d < half, d + half, d - half)
        sign = tl.where(d < half, -1.0, 1.0)
        cs_row = cos_sin_ptr + tl.load(positions_ptr + token).to(tl.int64) * stride_cs
        cos = tl.load(cs_row + d % half, mask=d_mask, other=0.0).to(tl.float32)
        sin = tl.load(cs_row + half + d % half, mask=d_mask, other=0.0).to(tl.float32)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if HAS_QK_NORM:
            q_w = tl.load(q_weight_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
            q_wp = tl.load(q_weight_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)
            k_w = tl.load(k_weight_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
            k_wp = tl.load(k_weight_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)
        else:  # unread
            q_w, q_wp, k_w, k_wp = cos, cos, cos, cos
        # The new key (the last position) is taken from registers after the loop: stop before it.
        last = seq_len - 1
        owns_new = (start <= last) & (last < end)
        end = tl.minimum(end, last)
    block_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if PREFETCH_KV:
        # Cached K/V predate this forward: the first tile's round trip may overlap the qkv GEMV.
        k, v, valid = _load_kv_tile(k_cache_ptr, v_cache_ptr, block_row, start, end, kv_head, d,
                                    d_mask, stride_btc, stride_kb, stride_ks, stride_kh,
                                    stride_vb, stride_vs, stride_vh,
                                    BLOCK_SIZE, BLOCK_N, NARROW_OFFSETS)
    if PDL:
        gdc_wait()
    if NEW_TOKENS:
        q = norm_rope_rows(q_rows, d, partner, q_mask, cos, sin, sign, q_w, q_wp, eps,
                            HAS_QK_NORM, HEAD_DIM)
        row_mask = d_mask[None, :]  # one head: a [1, BLOCK_D] tile
        k_new = norm_rope_rows(k_new_ptr + token * stride_knt + kv_head * stride_knh, d,
                                partner, row_mask, cos, sin, sign, k_w, k_wp, eps,
                                HAS_QK_NORM, HEAD_DIM)
        v_new = tl.load(v_new_ptr + token * stride_vnt + kv_head * stride_vnh + d[None, :],
                        mask=row_mask, other=0.0)
        k_new = k_new.to(k_cache_ptr.dtype.element_ty)
        v_new = v_new.to(v_cache_ptr.dtype.element_ty)
        # Padding rows (CUDA-graph batches) carry slot -1: nothing stored.
        store_mask = tl.where(owns_new & (slot >= 0), row_mask, False)
        cache_at = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_ks
        tl.store(k_cache_ptr + cache_at + kv_head * stride_kh + d[None, :], k_new, mask=store_mask)
        cache_at = (slot // BLOCK_SIZE) * stride_vb + (slot % BLOCK_SIZE) * stride_vs
        tl.store(v_cache_ptr + cache_at + kv_head * stride_vh + d[None, :], v_new, mask=store_mask)
    else:
        q = tl.load(q_rows + d[None, :], mask=q_mask, other=0.0)
    if FP16_PRODUCTS:  # an fp8 cache widens to fp16 in one instruction, to bf16 in several
        q = q.to(tl.float16)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    if SINKS and split == 0:
        # A head's sink is one more logit of its softmax, with no value: the first split's
        # running max and sum start from it (exp2(sink - sink) = 1).
        m_i = tl.load(sinks_ptr + head, mask=g_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.where(g_mask, 1.0, 0.0)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    loop_start = start
    if PREFETCH_KV:
        if start < end:  # an all-masked tile would give exp2(-inf - -inf)
            m_i, l_i, acc = _attend_tile(q, k, v, valid, m_i, l_i, acc, scale_log2,
                                         softcap_log2, DOT_PRECISION, SOFTCAP)
        loop_start = start + BLOCK_N
    for tile_start in range(loop_start, end, BLOCK_N):
        k, v, valid = _load_kv_tile(k_cache_ptr, v_cache_ptr, block_row, tile_start, end,
                                    kv_head, d, d_mask, stride_btc, stride_kb, stride_ks,
                                    stride_kh, stride_vb, stride_vs, stride_vh,
                                    BLOCK_SIZE, BLOCK_N, NARROW_OFFSETS)
        m_i, l_i, acc = _attend_tile(q, k, v, valid, m_i, l_i, acc, scale_log2, softcap_log2,
                                     DOT_PRECISION, SOFTCAP)
    if NEW_TOKENS:
        # The new key as one more step of the online softmax (zero weight outside its owner).
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * scale_log2
        if SOFTCAP:
            s_new = soft_cap(s_new, softcap_log2)
        s_new = tl.where(owns_new, s_new, float("-inf"))
        m_new = tl.maximum(m_i, s_new)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a program with no keys at all
        alpha = tl.exp2(m_i - m_safe)
        p_new = tl.exp2(s_new - m_safe)
        l_i = l_i * alpha + p_new
        # Rounded as the loop rounds P before its product with V.
        acc = acc * alpha[:, None] + (p_new.to(q.dtype).to(tl.float32)[:, None]
                                      * v_new.to(tl.float32))
        m_i = m_new

    # Empty sequences and splits (no keys) have l_i == 0: zeros, not NaN.
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + token * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # The split's normalised output and log2 softmax denominator, for `merge_splits`.
        part = (seq * num_heads + head) * NUM_SPLITS + split
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=g_mask)
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + d[None, :],
                 out.to(part_o_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _load_kv_tile(k_cache_ptr, v_cache_ptr, block_row, tile_start, end, kv_head, d, d_mask,
                  stride_btc, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NARROW_OFFSETS: tl.constexpr):
    """K and V at positions ``[tile_start, tile_start + BLOCK_N)`` below ``end``, and the mask."""
    pos = tile_start + tl.arange(0, BLOCK_N)
    valid = pos < end
    block = tl.load(block_row + (pos // BLOCK_SIZE) * stride_btc, mask=valid, other=0)
    offset = pos % BLOCK_SIZE
    kv_mask = valid[:, None] & d_mask[None, :]
    if NARROW_OFFSETS:  # V's strides are K's: one [BLOCK_N, D] tile of int32 offsets
        offsets = (block * stride_kb + offset * stride_ks)[:, None] + d[None, :]
        k = tl.load(k_cache_ptr + kv_head * stride_kh + offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_head * stride_vh + offsets, mask=kv_mask, other=0.0)
    else:
        block = block.to(tl.int64)
        k = tl.load(k_cache_ptr + (block * stride_kb + offset * stride_ks
                                   + kv_head * stride_kh)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + (block * stride_vb + offset * stride_vs
                                   + kv_head * stride_vh)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)
    return k, v, valid


@triton.jit
def _attend_tile(q, k, v, valid, m_i, l_i, acc, scale_log2, softcap_log2,
                 DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """One step of the online softmax: the q group against a tile of keys and values."""
    # An fp8 cache is widened to q's dtype for the products (a no-op when they match).
    k, v = k.to(q.dtype), v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if SOFTCAP:  # cap * tanh(s / cap) in base-2 units: both sides scaled by log2(e)
        s = soft_cap(s, softcap_log2)
    s = tl.where(valid[None, :], s, float("-inf"))  # every tile holds at least one valid key
    return online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)


@triton.jit
def merge_splits(part_lse_ptr, part_o_ptr, rows, d, d_mask,
                 NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The fp32 attention output of each ``seq * num_heads + head`` in ``rows``: its splits'
    outputs weighted by their share of the softmax denominator, ``exp2(lse_s) / sum exp2(lse)``."""
    # Split by split, every load's address known up front: all the loads are in flight at once.
    lse_rows = part_lse_ptr + rows * NUM_SPLITS
    out_rows = part_o_ptr + (rows * NUM_SPLITS)[:, None] * HEAD_DIM + d[None, :]
    top = tl.load(lse_rows)
    for i in tl.static_range(1, NUM_SPLITS):
        top = tl.maximum(top, tl.load(lse_rows + i))
    # Empty splits weigh 0; if all are empty, keep exp2 away from -inf - -inf (the output is 0).
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp2(tl.load(lse_rows) - top)
    total = weight
    out = weight[:, None] * tl.load(out_rows, mask=d_mask[None, :], other=0.0).to(tl.float32)
    for i in tl.static_range(1, NUM_SPLITS):
        weight = tl.exp2(tl.load(lse_rows + i) - top)
        total += weight
        o = tl.load(out_rows + i * HEAD_DIM, mask=d_mask[None, :], other=0.0)
        out += weight[:, None] * o.to(tl.float32)
    return out / tl.where(total > 0, total, 1.0)[:, None]


@triton.jit
def _decode_reduce_kernel(
    part_lse_ptr, part_o_ptr, query_start_loc_ptr, out_ptr,
    num_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # o_proj's batch-1 GEMV may start fetching its weights
        gdc_launch_dependents()
        gdc_wait()  # launched early too: the partial results come from the split kernel
    seq = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    row = seq * num_heads + head + tl.arange(0, 1)
    out = merge_splits(part_lse_ptr, part_o_ptr, row, d, d_mask, NUM_SPLITS, HEAD_DIM)
    token = tl.load(query_start_loc_ptr + seq)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=d_mask[None, :])
