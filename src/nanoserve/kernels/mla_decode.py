"""Multi-head latent attention on the GPU: one kernel rotates and stores, a split kernel
decodes. In the absorbed form a DeepSeek layer's decode is multi-query attention: every
head's query, taken through its key up-projection into the latent space and joined by its
rotated part, reads one shared KV "head" of width kv_lora_rank + qk_rope_head_dim, the cached
rows themselves, whose latent part are also the values. The split kernel reads each cached
row once, as key (all of it) and value (its latent part), for a block of heads;
``decode_attention``'s merge joins the splits, and the value up-projection finishes each
head. Prefill decompresses keys and values (``attention/mla_reference.py``). The split
count and tiles are data: :func:`select` (``configs/mla_decode/``)."""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanoserve.kernels.common import (LOG2E, device_sm_count, dot_precision, interpreted,
                                      online_softmax_step, programmatic_launch)
from nanoserve.kernels.decode_attention import (INTERPRETER_BLOCK_N, bucket_key, clamped_splits,
                                                num_decode_splits, split_choices)
from nanoserve.kernels.decode_kernels import _decode_reduce_kernel
from nanoserve.kernels.tuning import load_table, memoised, tuned


class MlaDecodeConfig(NamedTuple):
    """Launch options of the latent split kernel (:func:`latent_attention`)."""

    num_splits: int | None = None  # slices of each context; None: num_decode_splits'
    # A power of two, at least 16 (tl.dot's least rows); more heads take more programs.
    heads_per_program: int = 16
    block_n: int = 32  # keys a tile: a [32, 512] latent tile, the [16, 512] float32 accumulator
    num_warps: int = 8
    num_stages: int = 3  # Triton's default, which the launch had before it was tunable


def heuristic_config(num_seqs: int, num_heads: int, max_seq_len: int, num_sms: int
                     ) -> MlaDecodeConfig:
    """The launch for heads nobody tuned: the defaults, split as decode attention splits a
    KV head (here a block of heads: each program reads the whole context slice's rows)."""
    config = MlaDecodeConfig()
    head_blocks = triton.cdiv(num_heads, config.heads_per_program)
    return config._replace(num_splits=num_decode_splits(num_seqs, head_blocks, max_seq_len,
                                                        num_sms))


def shape_key(num_heads: int, rank: int, rope: int) -> str:
    """A tuning table's key: the heads (one rank's), the latent rank and the rope width. Its
    buckets are decode attention's (``bucket_key``): batch by context."""
    return f"{num_heads}x{rank}x{rope}"


def from_table(table: dict, num_seqs: int, num_heads: int, rank: int, rope: int,
               max_seq_len: int, num_sms: int) -> MlaDecodeConfig:
    """:func:`select`'s rule over one tuning table (``{shape_key: {bucket_key: entry}}``); a
    tuned split count is kept within what the context allows."""
    config = tuned(table, shape_key(num_heads, rank, rope), bucket_key(num_seqs, max_seq_len),
                   heuristic_config(num_seqs, num_heads, max_seq_len, num_sms))
    return config._replace(num_splits=clamped_splits(config.num_splits, max_seq_len))


@memoised
def select(num_seqs: int, num_heads: int, rank: int, rope: int, max_seq_len: int,
           device: torch.device) -> MlaDecodeConfig:
    """The split count and tiles of a latent decode launch of ``num_seqs`` sequences whose
    longest context is at most ``max_seq_len``: the device's tuning file's entry for the
    heads and bucket, else the heuristic's."""
    sms = device_sm_count(device)
    if interpreted(device):  # small tiles: a fast interpreter, short contexts span several
        return heuristic_config(num_seqs, num_heads, max_seq_len, sms)._replace(
            block_n=INTERPRETER_BLOCK_N, num_warps=1)
    return from_table(load_table("mla_decode", device), num_seqs, num_heads, rank, rope,
                      max_seq_len, sms)


# Tiles worth timing: (heads_per_program, block_n, num_warps, num_stages). Wider key tiles
# take fewer stages: a bf16 [64, 576] tile is 72 KB of shared memory a stage.
CANDIDATE_TILES = ((16, 32, 8, 3), (16, 16, 4, 3), (16, 32, 4, 3), (16, 64, 8, 2),
                   (32, 32, 8, 2), (32, 16, 8, 3))


def candidates(num_seqs: int, num_heads: int, max_seq_len: int, num_sms: int
               ) -> list[MlaDecodeConfig]:
    """Launches worth timing for one bucket: the heuristic's, and its split count, halved and
    doubled, by :data:`CANDIDATE_TILES` (blocks of 32 heads only where there are more than
    16: each cached row is then read by half the programs)."""
    base = heuristic_config(num_seqs, num_heads, max_seq_len, num_sms)
    found = [base] + [MlaDecodeConfig(n, heads, block_n, warps, stages)
                      for n in split_choices(base.num_splits, max_seq_len)
                      for heads, block_n, warps, stages in CANDIDATE_TILES
                      if heads == 16 or num_heads > 16]
    return list(dict.fromkeys(found))


@triton.jit
def _rope_store_latent_kernel(
    q_ptr, kv_ptr, pos_ptr, table_ptr, norm_ptr, cache_ptr, slot_ptr, q_out_ptr,
    eps, num_heads, stride_qt, stride_qh, stride_kv, stride_table, stride_ot, stride_oh,
    NOPE: tl.constexpr, RANK: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr,
):
    """One token: its heads' rope features of q rotated into ``q_out``; its latent normed and
    its rope key rotated, stored as one cache row (a slot of -1: padding, nothing stored).
    DeepSeek rotates interleaved pairs (2i, 2i + 1); the results are laid out half-split, as
    ``mla_reference.halves`` then the rotary formula give them."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    i_mask = i < HALF
    cos = tl.load(table_ptr + pos * stride_table + i, mask=i_mask, other=0.0)
    sin = tl.load(table_ptr + pos * stride_table + HALF + i, mask=i_mask, other=0.0)
    h = tl.arange(0, BLOCK_H)
    mask = (h < num_heads)[:, None] & i_mask[None, :]
    pairs = q_ptr + token * stride_qt + h[:, None] * stride_qh + NOPE + 2 * i[None, :]
    even = tl.load(pairs, mask=mask, other=0.0).to(tl.float32)
    odd = tl.load(pairs + 1, mask=mask, other=0.0).to(tl.float32)
    out = q_out_ptr + token * stride_ot + h[:, None] * stride_oh + i[None, :]
    tl.store(out, (even * cos - odd * sin).to(q_out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + HALF, (odd * cos + even * sin).to(q_out_ptr.dtype.element_ty), mask=mask)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        dtype = kv_ptr.dtype.element_ty
        row = cache_ptr + slot * (RANK + 2 * HALF)
        r = tl.arange(0, BLOCK_R)
        r_mask = r < RANK
        latent = tl.load(kv_ptr + token * stride_kv + r, mask=r_mask, other=0.0).to(tl.float32)
        # As RMSNorm rounds: the normalised row in the activations' dtype, then the weight.
        normed = (latent * tl.rsqrt(tl.sum(latent * latent, 0) / RANK + eps)).to(dtype)
        normed = normed.to(tl.float32) * tl.load(norm_ptr + r, mask=r_mask).to(tl.float32)
        tl.store(row + r, normed.to(dtype).to(cache_ptr.dtype.element_ty), mask=r_mask)
        k_pairs = kv_ptr + token * stride_kv + RANK + 2 * i
        k_even = tl.load(k_pairs, mask=i_mask, other=0.0).to(tl.float32)
        k_odd = tl.load(k_pairs + 1, mask=i_mask, other=0.0).to(tl.float32)
        tl.store(row + RANK + i, (k_even * cos - k_odd * sin).to(dtype)
                 .to(cache_ptr.dtype.element_ty), mask=i_mask)
        tl.store(row + RANK + HALF + i, (k_odd * cos + k_even * sin).to(dtype)
                 .to(cache_ptr.dtype.element_ty), mask=i_mask)


def rope_store_latent(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                      cos_sin: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """``mla_reference.rope_and_norm`` then ``store_latent`` in one launch, without a host sync
    (CUDA-graph safe): ``q`` ``[T, H, nope + rope]``, ``kv`` ``[T, rank + rope]`` (the
    projections' outputs, rope parts interleaved), ``cos_sin`` the rotary table. Returns
    ``[T, H, rope]``, the queries' rotated parts."""
    tokens, heads, width = q.shape
    rope = cos_sin.shape[-1]
    rank = kv.shape[-1] - rope
    if cache.shape[-1] != rank + rope:
        raise ValueError(f"cache rows hold {cache.shape[-1]} values, not {rank} + {rope}")
    if rope % 2 or width <= rope:
        raise ValueError(f"the rope part ({rope}) must be even and narrower than q ({width})")
    q_rope = torch.empty((tokens, heads, rope), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return q_rope
    if any(t.stride(-1) != 1 for t in (q, kv, cos_sin)):
        raise ValueError("rope_store_latent needs contiguous features")
    pdl = programmatic_launch(q.device)
    _rope_store_latent_kernel[(tokens,)](
        q, kv, positions, cos_sin, norm_weight, cache, slot_mapping, q_rope, eps, heads,
        q.stride(0), q.stride(1), kv.stride(0), cos_sin.stride(0), q_rope.stride(0),
        q_rope.stride(1), NOPE=width - rope, RANK=rank, HALF=rope // 2,
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_R=triton.next_power_of_2(rank),
        BLOCK_HALF=triton.next_power_of_2(rope // 2), PDL=pdl,
        num_warps=1 if interpreted(q.device) else 4, launch_pdl=pdl)
    return q_rope


# Split counts and table widths vary with the batch: runtime values, not a variant each.
@triton.jit(do_not_specialize=["stride_bt", "stride_btc", "num_splits"])
def _mla_split_kernel(
    q_latent_ptr, q_rope_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    seq_order_ptr, out_ptr, part_lse_ptr, part_o_ptr, scale_log2, num_heads, num_splits,
    stride_lt, stride_lh, stride_rt, stride_rh, stride_cb, stride_cs, stride_bt, stride_btc,
    stride_ot, stride_oh,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, ORDERED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """A block of heads of one sequence against one slice of its context: scores from the
    latent and rope parts of each cached row, values its latent part, the same loaded tile."""
    if PDL:
        gdc_launch_dependents()
    rank = tl.program_id(0)
    seq = tl.load(seq_order_ptr + rank) if ORDERED else rank
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = head < num_heads
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    r_mask, p_mask = r < RANK, p < ROPE
    token = tl.load(query_start_loc_ptr + seq)
    if PDL:
        gdc_wait()
    q_latent = tl.load(q_latent_ptr + token * stride_lt + head[:, None] * stride_lh + r[None, :],
                       mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    q_rope = tl.load(q_rope_ptr + token * stride_rt + head[:, None] * stride_rh + p[None, :],
                     mask=h_mask[:, None] & p_mask[None, :], other=0.0)
    block_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        valid = pos < end
        # Column-major tables too (the decode graphs' arena): the column stride is an input.
        block = tl.load(block_row + (pos // BLOCK_SIZE) * stride_btc, mask=valid,
                        other=0).to(tl.int64)
        rows = cache_ptr + block * stride_cb + (pos % BLOCK_SIZE) * stride_cs
        latent = tl.load(rows[:, None] + r[None, :], mask=valid[:, None] & r_mask[None, :],
                         other=0.0).to(q_latent.dtype)
        k_rope = tl.load(rows[:, None] + RANK + p[None, :],
                         mask=valid[:, None] & p_mask[None, :], other=0.0).to(q_rope.dtype)
        s = tl.dot(q_latent, tl.trans(latent), input_precision=DOT_PRECISION)
        s = tl.dot(q_rope, tl.trans(k_rope), s, input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, latent, m_i, l_i, acc, DOT_PRECISION)
    has_keys = l_i > 0  # an empty split: zeros and lse -inf, not NaN
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    mask = h_mask[:, None] & r_mask[None, :]
    if not SPLIT:
        tl.store(out_ptr + token * stride_ot + head[:, None] * stride_oh + r[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # laid out as decode_attention's partials, for its merge kernel
        part = (seq * num_heads + head) * num_splits + split
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=h_mask)
        tl.store(part_o_ptr + part[:, None] * RANK + r[None, :], out, mask=mask)


def latent_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     query_start_loc: torch.Tensor, max_seq_len: int, scale: float,
                     num_splits: int | None = None, seq_order: torch.Tensor | None = None,
                     config: MlaDecodeConfig | None = None) -> torch.Tensor:
    """``[T, H, rank]`` (stored heads first): each head's absorbed query, ``q_latent`` ``[T, H,
    rank]`` and ``q_rope`` ``[T, H, rope]`` (any head and token strides), attending over the
    latent cache ``[blocks, block_size, 1, rank + rope]``, each row's first ``rank`` features
    its value. Sequences and splits as ``decode_attention``'s; graph-capturable. ``config``:
    the launch (default: :func:`select`'s; ``num_splits`` overrides its split count)."""
    tokens, heads, rank = q_latent.shape
    rope = q_rope.shape[-1]
    num_seqs, block_size = seq_lens.shape[0], cache.shape[1]
    if (cache.shape[-1] != rank + rope or cache.shape[2] != 1
            or q_rope.shape[:2] != (tokens, heads)):
        raise ValueError(f"queries [T, H, {rank}] and [T, H, {rope}] read a latent cache of "
                         f"rows {rank} + {rope} wide, one head; got cache {tuple(cache.shape)}")
    if q_latent.stride(-1) != 1 or q_rope.stride(-1) != 1:
        raise ValueError("latent_attention needs the queries' features contiguous")
    device = q_latent.device
    out = torch.empty((heads, tokens, rank), dtype=q_latent.dtype, device=device).transpose(0, 1)
    if num_seqs == 0:
        return out
    config = config or select(num_seqs, heads, rank, rope, max_seq_len, device)
    block_h = config.heads_per_program
    head_blocks = triton.cdiv(heads, block_h)
    num_splits = num_splits or config.num_splits or num_decode_splits(
        num_seqs, head_blocks, max_seq_len, device_sm_count(device))
    part_lse = part_o = out  # typed placeholders with one split
    if num_splits > 1:
        part_lse = torch.empty((num_seqs, heads, num_splits), dtype=torch.float32,
                               device=device)
        part_o = torch.empty((num_seqs, heads, num_splits, rank), dtype=torch.float32,
                             device=device)
    pdl = programmatic_launch(device)
    _mla_split_kernel[(num_seqs, head_blocks, num_splits)](
        q_latent, q_rope, cache, block_tables, seq_lens, query_start_loc,
        seq_lens if seq_order is None else seq_order, out, part_lse, part_o,
        scale * LOG2E, heads, num_splits, q_latent.stride(0), q_latent.stride(1),
        q_rope.stride(0), q_rope.stride(1), cache.stride(0), cache.stride(1),
        block_tables.stride(0), block_tables.stride(1), out.stride(0), out.stride(1),
        RANK=rank, ROPE=rope, BLOCK_R=triton.next_power_of_2(rank),
        BLOCK_P=max(triton.next_power_of_2(rope), 16), BLOCK_H=block_h,
        BLOCK_SIZE=block_size, BLOCK_N=config.block_n,
        SPLIT=num_splits > 1, ORDERED=seq_order is not None,
        DOT_PRECISION=dot_precision(q_latent.dtype), PDL=pdl,
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl)
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, heads)](
            part_lse, part_o, query_start_loc, out, heads, out.stride(0), out.stride(1),
            HEAD_DIM=rank, BLOCK_D=triton.next_power_of_2(rank), NUM_SPLITS=num_splits,
            PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


def mla_decode_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor,
                         query_start_loc: torch.Tensor, max_seq_len: int, kv_b: torch.Tensor,
                         v_head_dim: int, scale: float, num_splits: int | None = None,
                         seq_order: torch.Tensor | None = None,
                         config: MlaDecodeConfig | None = None) -> torch.Tensor:
    """``[T, H, v_head_dim]``, as ``mla_reference.mla_decode``: ``q_nope`` ``[T, H, nope]``,
    ``q_rope`` ``[T, H, rope]`` (rotated), ``cache`` ``[blocks, block_size, 1, rank + rope]``,
    ``kv_b`` ``[H * (nope + v_head_dim), rank]``; the rest as :func:`latent_attention`'s. The
    batched products run head-major: each takes strided views and gives a fresh tensor."""
    heads, nope = q_nope.shape[1], q_nope.shape[2]
    w = kv_b.view(heads, nope + v_head_dim, kv_b.shape[-1])
    q_latent = torch.bmm(q_nope.transpose(0, 1), w[:, :nope])  # [H, T, rank]
    out = latent_attention(q_latent.transpose(0, 1), q_rope, cache, block_tables, seq_lens,
                           query_start_loc, max_seq_len, scale, num_splits, seq_order,
                           config)
    return torch.bmm(out.transpose(0, 1), w[:, nope:].transpose(1, 2)).transpose(0, 1)
