"""Paged decode attention (one query token per sequence), split along the context.

Flash-decoding (docs/kernels.md): each program attends one KV head's query group to one slice of
a sequence's context; ``merge_splits`` merges the slices by their softmax denominators. Given
``NewTokens`` the split kernel also does ``qk_norm_rope_store``'s work (one launch per layer
fewer), attending to the new k/v from registers.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton

from nanoserve.kernels.common import (LOG2E, check_attention_inputs, device_sm_count,
                                      dot_precision, fp16_products, interpreted,
                                      programmatic_launch)
from nanoserve.kernels.decode_kernels import _decode_reduce_kernel, _decode_split_kernel
from nanoserve.kernels.qk_norm_rope import NewTokens


class DecodeTuning(NamedTuple):
    """Launch options of the split kernel (docs/kernels.md explains the defaults)."""

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


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     query_start_loc: torch.Tensor, max_seq_len: int, scale: float,
                     num_splits: int | None = None,
                     tuning: DecodeTuning = DecodeTuning(),
                     seq_order: torch.Tensor | None = None,
                     new_tokens: NewTokens | None = None, window: int = 0,
                     softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context; returns ``[T, H, D]``.

    Sequence ``i``'s token is row ``query_start_loc[i]`` of ``q [T, H, D]``, its keys the first
    ``seq_lens[i]`` cache entries through ``block_tables[i]``. ``max_seq_len`` (a Python int)
    only sizes the split count (``num_splits`` overrides it). ``seq_order`` (``[B]`` int32,
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
    if num_splits is None:
        num_splits = num_decode_splits(num_seqs, num_kv_heads, max_seq_len, device_sm_count(device))
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

