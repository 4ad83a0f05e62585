"""Paged decode attention (one query token per sequence), split along the context.

Flash-decoding (docs/kernels.md): each program attends one KV head's query group to one slice of
a sequence's context; ``merge_splits`` merges the slices by their softmax denominators. Given
``NewTokens`` the split kernel also does ``qk_norm_rope_store``'s work (one launch per layer
fewer), attending to the new k/v from registers. :func:`select` picks the split count and tiles
for a launch: the device's tuning file's where it has the heads and the batch and context
buckets, else :func:`heuristic_config`.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton

from nanoserve.kernels.common import (LOG2E, check_attention_inputs, device_sm_count,
                                      dot_precision, fp16_products, interpreted,
                                      programmatic_launch)
from nanoserve.kernels.tuning import BATCH_BUCKETS, bucket, load_table, memoised, tuned
from nanoserve.kernels.decode_kernels import _decode_reduce_kernel, _decode_split_kernel
from nanoserve.kernels.qk_norm_rope import NewTokens


class DecodeTuning(NamedTuple):
    """Launch options of the split kernel (docs/kernels.md explains the defaults)."""

    num_splits: int | None = None  # slices of the context; None: num_decode_splits'
    block_n: int = 64  # keys per inner-loop tile
    num_warps: int = 4
    # Block-table loads get (num_stages - 1) // 2 buffers: 3 keeps one K/V tile in flight.
    num_stages: int = 3
    heads_first: bool = True  # grid (KV head, sequence, split), not (sequence, KV head, split)
    # One set of int32 offsets for K and V (equal strides, cache < 2^31 elements): fewer registers.
    narrow_offsets: bool = True
    # With new tokens: load the first K/V tile before waiting for qkv (it writes no cached key).
    prefetch_kv: bool = False


MIN_TOKENS_PER_SPLIT = 64
# Enough for one long sequence of a model with two KV heads to fill a large GPU.
MAX_SPLITS = 128
PROGRAMS_PER_SM = 5
# Batches up to this size are latency-bound: split to fill the GPU, new tokens finished in-kernel.
LATENCY_MAX_SEQS = 8
BALANCE_BELOW = 7.5
BALANCE_TARGET = 15
# Heads wider than this (Gemma's 256) take smaller key tiles, decode and prefill alike.
WIDE_HEAD_DIM = 128
# Small tiles on CPU: a fast interpreter, and short test sequences span several tiles.
INTERPRETER_BLOCK_N = 16

# With new tokens to finish, a split's first K/V tile is read before waiting for qkv.
SPLIT_DECODE_TUNING = DecodeTuning(narrow_offsets=False, prefetch_kv=True)
# A split of one tile has nothing to pipeline: without stages the programs start sooner.
ONE_TILE_SPLIT_TUNING = SPLIT_DECODE_TUNING._replace(num_stages=1)
# The prefetched tile costs registers: launches larger than this many programs per SM skip it.
PREFETCH_PROGRAMS_PER_SM = 3
# An fp8 cache's K/V are read faster by two warps per program than by four.
FP8_DECODE_TUNING = DecodeTuning(num_warps=2)
# Tuning-table buckets besides the batch's: the context caps decode graphs are captured for
# (runner/cuda_graph.py), the last for any longer context.
CONTEXT_BUCKETS = (512, 2048, 8192, 32768, 131072)


def num_decode_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many context splits a decode launch uses, from host-side ints only: up to
    ``LATENCY_MAX_SEQS`` sequences, ``PROGRAMS_PER_SM`` programs per SM; larger batches below
    ``BALANCE_BELOW`` per SM split to ``BALANCE_TARGET`` (ragged contexts even out over more
    waves). No slice is under ``MIN_TOKENS_PER_SPLIT`` keys."""
    programs = max(num_seqs * num_kv_heads, 1)
    if num_seqs <= LATENCY_MAX_SEQS:
        wanted = PROGRAMS_PER_SM * num_sms // programs
    elif programs < BALANCE_BELOW * num_sms:
        wanted = math.ceil(BALANCE_TARGET * num_sms / programs)
    else:
        wanted = 1
    return max(1, min(wanted, max_seq_len // MIN_TOKENS_PER_SPLIT, MAX_SPLITS))


def split_decode_tuning(programs: int, max_seq_len: int, splits: int, num_sms: int
                        ) -> DecodeTuning:
    """The tiles of a launch that finishes new tokens: the prefetch only within
    ``PREFETCH_PROGRAMS_PER_SM``, and then one stage where a split is at most one tile."""
    if programs > PREFETCH_PROGRAMS_PER_SM * num_sms:
        return SPLIT_DECODE_TUNING._replace(prefetch_kv=False)
    tiles = -(-max_seq_len // SPLIT_DECODE_TUNING.block_n)
    return ONE_TILE_SPLIT_TUNING if tiles <= splits else SPLIT_DECODE_TUNING


def heuristic_config(num_seqs: int, num_kv_heads: int, max_seq_len: int, fp8: bool,
                     new_tokens: bool, num_sms: int) -> DecodeTuning:
    """Splits and tiles for heads nobody tuned: :func:`num_decode_splits`' splits; with new
    tokens :func:`split_decode_tuning`'s tiles, else the defaults (two warps over fp8)."""
    splits = num_decode_splits(num_seqs, num_kv_heads, max_seq_len, num_sms)
    if new_tokens:
        tiles = split_decode_tuning(num_seqs * num_kv_heads * splits, max_seq_len, splits,
                                    num_sms)
    else:
        tiles = FP8_DECODE_TUNING if fp8 else DecodeTuning()
    return tiles._replace(num_splits=splits)


def shape_key(num_heads: int, num_kv_heads: int, head_dim: int, fp8: bool,
              new_tokens: bool) -> str:
    """A tuning table's key: the heads, the cache's dtype and whether new tokens are finished."""
    return (f"{num_heads}x{num_kv_heads}x{head_dim}" + (",fp8" if fp8 else "")
            + (",new_tokens" if new_tokens else ""))


def bucket_key(num_seqs: int, max_seq_len: int) -> str:
    return f"{bucket(num_seqs, BATCH_BUCKETS)}x{bucket(max_seq_len, CONTEXT_BUCKETS)}"


def clamped_splits(num_splits: int, max_seq_len: int) -> int:
    """``num_splits`` (a tuned count) within what ``max_seq_len`` allows: no slice under
    ``MIN_TOKENS_PER_SPLIT`` keys, at most ``MAX_SPLITS``."""
    return max(1, min(num_splits, max_seq_len // MIN_TOKENS_PER_SPLIT, MAX_SPLITS))


def split_choices(num_splits: int, max_seq_len: int) -> list[int]:
    """Split counts worth timing beside the heuristic's ``num_splits``: it, half, double."""
    return sorted({clamped_splits(num_splits * f // 2, max_seq_len) for f in (1, 2, 4)})


def from_table(table: dict, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
               max_seq_len: int, fp8: bool, new_tokens: bool, num_sms: int) -> DecodeTuning:
    """:func:`select`'s rule over one tuning table (``{shape_key: {bucket_key: entry}}``); a
    tuned split count is kept within what the context allows."""
    config = tuned(table, shape_key(num_heads, num_kv_heads, head_dim, fp8, new_tokens),
                   bucket_key(num_seqs, max_seq_len),
                   heuristic_config(num_seqs, num_kv_heads, max_seq_len, fp8, new_tokens,
                                    num_sms))
    return config._replace(num_splits=clamped_splits(config.num_splits, max_seq_len))


@memoised
def select(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
           kv_dtype: torch.dtype, new_tokens: bool, device: torch.device) -> DecodeTuning:
    """The split count and tiles of a decode launch of ``num_seqs`` sequences whose longest
    context is at most ``max_seq_len``, finishing their new tokens or not."""
    return from_table(load_table("decode_attention", device), num_seqs, num_heads,
                      num_kv_heads, head_dim, max_seq_len, kv_dtype == torch.float8_e4m3fn,
                      new_tokens, device_sm_count(device))


def candidates(num_seqs: int, num_kv_heads: int, max_seq_len: int, fp8: bool,
               new_tokens: bool, num_sms: int) -> list[DecodeTuning]:
    """Launches worth timing for one bucket: the heuristic's, and its split count, halved and
    doubled, with key tiles of 32 or 64 over 2 or 4 warps, pipelined or not."""
    base = heuristic_config(num_seqs, num_kv_heads, max_seq_len, fp8, new_tokens, num_sms)
    found = [base] + [base._replace(num_splits=n, block_n=b, num_warps=w, num_stages=stages)
                      for n in split_choices(base.num_splits, max_seq_len)
                      for b in (32, 64) for w in (2, 4) for stages in (1, 3)]
    return list(dict.fromkeys(found))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     query_start_loc: torch.Tensor, max_seq_len: int, scale: float,
                     num_splits: int | None = None,
                     tuning: DecodeTuning | None = None,
                     seq_order: torch.Tensor | None = None,
                     new_tokens: NewTokens | None = None, window: int = 0,
                     softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context; returns ``[T, H, D]``.

    Sequence ``i``'s token is row ``query_start_loc[i]`` of ``q [T, H, D]``, its keys the first
    ``seq_lens[i]`` cache entries through ``block_tables[i]``. ``max_seq_len`` (a Python int)
    only sizes the launch: ``tuning`` (default: :func:`select`'s; ``num_splits`` overrides its
    split count). ``seq_order`` (``[B]`` int32,
    longest context first) is the order programs take sequences in (default: batch order).
    With ``new_tokens``, ``q`` is the projection's raw q (left unmodified) and the kernel
    finishes and stores each new k/v itself, at ``seq_lens[i] - 1``. ``window`` > 0: only the
    last ``window`` keys are read; ``softcap`` > 0: scores are soft-capped (``softcap *
    tanh(s / softcap)``); ``sinks`` ([H]): one more logit per head's softmax, all as
    ``paged_attention_reference``. CUDA-graph capturable.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    check_attention_inputs(q, k_cache, v_cache)
    group = num_heads // num_kv_heads
    device = q.device
    if tuning is None:
        tuning = select(num_seqs, num_heads, num_kv_heads, head_dim, max_seq_len, k_cache.dtype,
                        new_tokens is not None, device)
    num_splits = num_splits or tuning.num_splits or num_decode_splits(
        num_seqs, num_kv_heads, max_seq_len, device_sm_count(device))
    block_n = INTERPRETER_BLOCK_N if interpreted(device) else tuning.block_n
    if head_dim > WIDE_HEAD_DIM:  # Gemma's 256: half the keys per tile keeps K/V in SRAM
        block_n = min(block_n, 32)
    block_d = max(triton.next_power_of_2(head_dim), 16)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=device)
    if num_seqs == 0:
        return out
    if num_splits > 1:
        part_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32,
                               device=device)
        # float32 for the reduce, which rounds once, at the end.
        part_o = torch.empty((num_seqs, num_heads, num_splits, head_dim),
                             dtype=torch.float32, device=device)
    else:  # the partial buffers are never touched: pass the output as a typed placeholder
        part_lse = part_o = out

    if new_tokens is None:  # typed placeholders, never read
        new_pointers, new_strides = (q, q, seq_lens, seq_lens, q, q, q), (0, 0, 0, 0, 0)
    else:
        new_tokens.check(num_tokens, num_kv_heads, head_dim)
        new_pointers, new_strides = new_tokens.kernel_args()
    pdl = programmatic_launch(device)
    grid = ((num_kv_heads, num_seqs, num_splits) if tuning.heads_first
            else (num_seqs, num_kv_heads, num_splits))
    _decode_split_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        seq_lens if seq_order is None else seq_order,  # an int32 placeholder when unordered
        out, part_lse, part_o, q if sinks is None else sinks, *new_pointers,
        scale * LOG2E, 0.0 if new_tokens is None else new_tokens.eps, window,
        softcap * LOG2E, num_heads,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), block_tables.stride(1),
        out.stride(0), out.stride(1), *new_strides,
        GROUP=group, BLOCK_G=max(triton.next_power_of_2(group), 16),
        HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, DOT_PRECISION=dot_precision(q.dtype),
        HEADS_FIRST=tuning.heads_first, ORDERED=seq_order is not None, PDL=pdl,
        NEW_TOKENS=new_tokens is not None,
        HAS_QK_NORM=new_tokens is not None and new_tokens.q_weight is not None,
        NARROW_OFFSETS=(tuning.narrow_offsets and k_cache.stride() == v_cache.stride()
                        and k_cache.numel() < 2 ** 31),
        FP16_PRODUCTS=fp16_products(q, k_cache),
        PREFETCH_KV=tuning.prefetch_kv and new_tokens is not None, SOFTCAP=softcap > 0,
        SINKS=sinks is not None,
        num_warps=tuning.num_warps, num_stages=tuning.num_stages, launch_pdl=pdl,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_lse, part_o, query_start_loc, out,
            num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
            PDL=pdl, num_warps=4, launch_pdl=pdl,
        )
    return out

