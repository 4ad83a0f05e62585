"""Variable-length causal attention over a paged cache: prefill, chunked prefill, mixed batches.

A program runs an fp32 online softmax for ``BLOCK_Q`` new tokens of one sequence times one KV
head's query group (each K/V tile serves the group), taking its (sequence, tile) from a host-built
list, most keys first (``prefill_work``): none idles, no long tile runs last (docs/kernels.md).
The launch's tiles, warps and stages are data: :func:`select` (``configs/prefill_attention/``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanoserve.attention.prefill_work import prefill_work
from nanoserve.kernels.decode_attention import WIDE_HEAD_DIM
from nanoserve.kernels.common import (LOG2E, check_attention_inputs, dot_precision,
                                      fp16_products, interpreted, masked_softmax_step,
                                      online_softmax_step, soft_cap)
from nanoserve.kernels.tuning import load_table, memoised, tuned


class PrefillConfig(NamedTuple):
    """Launch options of one prefill-attention launch (docs/kernels.md). ``block_m`` also
    sets the query tile the runner lists the programs by (:func:`query_tile`): the work list
    and the launch must come from the same config."""

    block_m: int = 64  # query rows (tokens x group heads) a program
    block_n: int = 64  # keys a tile
    num_warps: int = 4
    num_stages: int = 3


# Small tiles under TRITON_INTERPRET: faster on CPU, and short test sequences span many tiles.
INTERPRETER_CONFIG = PrefillConfig(block_m=16, block_n=16)


def shape_key(num_heads: int, num_kv_heads: int, head_dim: int) -> str:
    """A tuning table's key: the heads (one rank's). Its one bucket is ``"all"``: the tile is
    fixed for the run (the runner plans every step's work list with it)."""
    return f"{num_heads}x{num_kv_heads}x{head_dim}"


def heuristic_config(head_dim: int) -> PrefillConfig:
    """The launch for heads nobody tuned: the defaults; heads wider than ``WIDE_HEAD_DIM``
    (Gemma's 256) take half the keys a tile and one stage fewer, keeping K/V in SRAM."""
    if head_dim > WIDE_HEAD_DIM:
        return PrefillConfig(block_n=32, num_stages=2)
    return PrefillConfig()


def from_table(table: dict, num_heads: int, num_kv_heads: int, head_dim: int) -> PrefillConfig:
    """:func:`select`'s rule over one tuning table (``{shape_key: {"all": entry}}``)."""
    return tuned(table, shape_key(num_heads, num_kv_heads, head_dim), "all",
                 heuristic_config(head_dim))


@memoised
def select(num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device
           ) -> PrefillConfig:
    """The launch for these heads on ``device``: its tuning file's entry, else the heuristic's."""
    if interpreted(device):
        return INTERPRETER_CONFIG
    return from_table(load_table("prefill_attention", device), num_heads, num_kv_heads,
                      head_dim)


def candidates(num_heads: int, num_kv_heads: int, head_dim: int) -> list[PrefillConfig]:
    """Launches worth timing for these heads: the heuristic's, then 32-128 query rows (at
    least a token's group) by key tiles of 32-128 (16-32 for wide heads, whose tiles fill
    SRAM sooner), two pipeline depths each."""
    group_rows = triton.next_power_of_2(num_heads // num_kv_heads)
    wide = head_dim > WIDE_HEAD_DIM
    found = [heuristic_config(head_dim)] + [
        PrefillConfig(block_m, block_n, 8 if block_m >= 128 else 4, stages)
        for block_m in sorted({max(m, group_rows) for m in (32, 64, 128)})
        for block_n in ((16, 32) if wide else (32, 64, 128))
        for stages in ((1, 2) if wide else (2, 3))]
    return list(dict.fromkeys(found))


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, q_pos, tile_start, kv_start, kv_end,
    block_row, k_cache_ptr, v_cache_ptr, kv_head,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    scale_log2, window, softcap_log2, d, d_mask,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """One online-softmax step of a query tile against keys ``tile_start : tile_start+BLOCK_N``
    (with a window, none read before ``kv_start``: their blocks may be freed)."""
    pos = tile_start + tl.arange(0, BLOCK_N)
    if CAUSAL_MASK:
        valid = pos < kv_end
        if WINDOW:
            valid = valid & (pos >= kv_start)
        block = tl.load(block_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        kv_mask = valid[:, None] & d_mask[None, :]
    else:  # tiles wholly before the first query: every key is in range and visible to all rows
        block = tl.load(block_row + pos // BLOCK_SIZE).to(tl.int64)
        kv_mask = d_mask[None, :]
    offset = pos % BLOCK_SIZE
    k = tl.load(k_cache_ptr + (block * stride_kb + offset * stride_ks + kv_head * stride_kh)[:, None]
                + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + (block * stride_vb + offset * stride_vs + kv_head * stride_vh)[:, None]
                + d[None, :], mask=kv_mask, other=0.0)
    k, v = k.to(q.dtype), v.to(q.dtype)  # an fp8 cache, widened for the products
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if SOFTCAP:  # cap * tanh(s / cap) in base-2 units: both sides scaled by log2(e)
        s = soft_cap(s, softcap_log2)
    if CAUSAL_MASK:
        # Keys past kv_end sit past every valid row's position, so this also hides them.
        s = tl.where(pos[None, :] <= q_pos[:, None], s, float("-inf"))
    if WINDOW:  # a row sees keys after q_pos - window only: some rows may see none of a tile
        s = tl.where(pos[None, :] > q_pos[:, None] - window, s, float("-inf"))
        return masked_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)
    return online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)


# The block table's width and the work list's length change every step: no specialising on them.
@triton.jit(do_not_specialize=["stride_bt", "num_work"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
    sinks_ptr, work_ptr, num_work,
    scale_log2, window, softcap_log2,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP16_PRODUCTS: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    item = tl.program_id(0) // NUM_KV_HEADS
    kv_head = tl.program_id(0) % NUM_KV_HEADS
    seq = tl.load(work_ptr + item)
    tile = tl.load(work_ptr + num_work + item)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # keys already cached before this step's tokens

    # Row r is token (tile * BLOCK_Q + r // GROUP_P) of the sequence, head r % GROUP_P of the group.
    r = tl.arange(0, BLOCK_Q * GROUP_P)
    t = tile * BLOCK_Q + r // GROUP_P
    g = r % GROUP_P
    head = kv_head * GROUP + g
    row_mask = (t < q_len) & (g < GROUP)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    io_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + (q_start + t)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=io_mask, other=0.0)
    if FP16_PRODUCTS:  # an fp8 cache widens to fp16 in one instruction, to bf16 in several
        q = q.to(tl.float16)
    q_pos = ctx_len + t

    m_i = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
    if SINKS:  # each head's sink: one more logit with no value, where the softmax starts
        m_i = tl.load(sinks_ptr + head, mask=g < GROUP, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.where(g < GROUP, 1.0, 0.0)
    acc = tl.zeros([BLOCK_Q * GROUP_P, BLOCK_D], tl.float32)
    block_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    first_q_pos = ctx_len + tile * BLOCK_Q
    kv_end = tl.minimum(seq_len, first_q_pos + BLOCK_Q)  # causal: nothing past the last row
    if WINDOW:
        # Every tile masked, from the first one holding a key of the first row's window:
        # the keys before it are never read.
        kv_start = tl.maximum(first_q_pos - window + 1, 0)
        masked_start = (kv_start // BLOCK_N) * BLOCK_N
        unmasked_end = 0
    else:
        kv_start = 0
        masked_start = (first_q_pos // BLOCK_N) * BLOCK_N
        unmasked_end = masked_start
    # Key 0 is visible to every row, so m_i is finite after the first tile: no exp2(-inf - -inf).
    for tile_start in range(0, unmasked_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, q_pos, tile_start, kv_start, kv_end, block_row, k_cache_ptr,
            v_cache_ptr, kv_head, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            scale_log2, window, softcap_log2, d, d_mask, BLOCK_SIZE, BLOCK_N, False,
            DOT_PRECISION, False, SOFTCAP)
    for tile_start in range(masked_start, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, q_pos, tile_start, kv_start, kv_end, block_row, k_cache_ptr,
            v_cache_ptr, kv_head, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            scale_log2, window, softcap_log2, d, d_mask, BLOCK_SIZE, BLOCK_N, True,
            DOT_PRECISION, WINDOW, SOFTCAP)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + t)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


def query_tile(num_heads: int, num_kv_heads: int, config: PrefillConfig) -> int:
    """New tokens of one sequence per program: the ``config.block_m`` rows hold a KV head's
    query group per token, so large groups take fewer tokens (``tl.dot`` needs 16 rows or
    more)."""
    return max(config.block_m // triton.next_power_of_2(num_heads // num_kv_heads), 1)


def work_on_device(query_lens: list[int], seq_lens: list[int], num_heads: int,
                   num_kv_heads: int, device: torch.device,
                   config: PrefillConfig | None = None) -> torch.Tensor:
    """:func:`prefill_work` for ``config``'s query tile on ``device`` (tests, benchmarks).
    ``config``: the launch's; the interpreter's by default, required on CUDA, where
    :func:`select`'s depends on the head size."""
    if config is None:
        if not interpreted(device):
            raise ValueError("on CUDA the query tile depends on the head size: pass the "
                             "launch's config (select's)")
        config = INTERPRETER_CONFIG
    tile = query_tile(num_heads, num_kv_heads, config)
    return torch.from_numpy(prefill_work(query_lens, seq_lens, tile)).to(device)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, scale: float,
                      work: torch.Tensor | None = None, window: int = 0,
                      softcap: float = 0.0, sinks: torch.Tensor | None = None,
                      config: PrefillConfig | None = None) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequences' paged keys; ``[T, H, D]``.

    Sequence ``i`` owns rows ``query_start_loc[i] : query_start_loc[i+1]`` of ``q`` (later rows
    stay unwritten), its keys the first ``seq_lens[i]`` cache entries, new tokens stored. ``work``:
    :func:`prefill_work` for ``config``'s :func:`query_tile` (default: from lengths read back).
    ``window`` > 0: a token sees the last ``window`` positions only; ``softcap`` > 0: scores
    soft-capped; ``sinks`` ([H]): one more logit per head's softmax, as
    ``paged_attention_reference``. ``config``: the launch (default: :func:`select`'s)."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_attention_inputs(q, k_cache, v_cache)
    group = num_heads // num_kv_heads
    config = config or select(num_heads, num_kv_heads, head_dim, q.device)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if work is None:
        starts = query_start_loc.tolist()
        work = work_on_device([b - a for a, b in zip(starts, starts[1:])], seq_lens.tolist(),
                              num_heads, num_kv_heads, q.device, config)
    num_work = work.shape[1]
    if num_work == 0:
        return out
    _prefill_kernel[(num_work * num_kv_heads,)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        q if sinks is None else sinks, work, num_work,
        scale * LOG2E, window, softcap * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_P=triton.next_power_of_2(group),
        BLOCK_Q=query_tile(num_heads, num_kv_heads, config),
        HEAD_DIM=head_dim, BLOCK_D=max(triton.next_power_of_2(head_dim), 16),
        BLOCK_SIZE=block_size, BLOCK_N=config.block_n,
        DOT_PRECISION=dot_precision(q.dtype), FP16_PRODUCTS=fp16_products(q, k_cache),
        WINDOW=window > 0, SOFTCAP=softcap > 0, SINKS=sinks is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
