"""Attention backend for CUDA: Triton kernels for q/k norm + RoPE + KV store, decode and prefill."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nanoserve.attention.metadata import AttentionMetadata
from nanoserve.kernels.common import device_sm_count
from nanoserve.kernels.decode_attention import (LATENCY_MAX_SEQS, DecodeTuning, NewTokens,
                                                decode_attention, num_decode_splits)
from nanoserve.kernels.prefill_attention import prefill_attention, query_tile
from nanoserve.kernels.qk_norm_rope import qk_norm_rope_store

if TYPE_CHECKING:
    from nanoserve.layers.norm import RMSNorm
    from nanoserve.layers.rotary import RotaryEmbedding


SPLIT_DECODE_TUNING = DecodeTuning(narrow_offsets=False, prefetch_kv=True)
# Splits of one tile (a batch-1 graph captured for a short context) have nothing to pipeline:
# without the stages' shared memory the programs start sooner, beside the projection they
# wait for.
ONE_TILE_SPLIT_TUNING = SPLIT_DECODE_TUNING._replace(num_stages=1)
# The prefetched tile is live through the wait: compiled for sm_90, 168 registers against 165
# with Triton 3.6 (three programs per SM either way), 145 against 114 with Triton 3.9 (three
# instead of four). Launches that fit the device at three per SM (batch 1: 8 KV heads x 32
# splits) take it; larger ones keep their occupancy.
PREFETCH_PROGRAMS_PER_SM = 3
# Over an fp8 cache, two warps per program read the throughput workload's K/V 15% faster than
# four.
FP8_DECODE_TUNING = DecodeTuning(num_warps=2)


class TritonAttentionBackend:
    """GPU path: flash-decoding for decode-only batches, paged varlen prefill for the rest.

    In split decode of small batches (up to ``LATENCY_MAX_SEQS`` sequences) the split kernel
    also applies the q/k norms and RoPE and stores the new K/V (one launch); otherwise
    ``qk_norm_rope_store`` does, then the decode or prefill kernel attends.

    Nothing here reads device values on the host, so the decode path can be captured in a CUDA
    graph (run it once outside capture first, so Triton compiles its kernels). The decode split
    count is chosen from ``meta.max_seq_len`` at capture time and stays fixed in the graph; the
    kernel partitions each sequence's actual length at replay, so results stay correct for any
    length, but a graph captured with a short ``max_seq_len`` under-splits long contexts.
    """

    def prefill_tile(self, num_heads: int, num_kv_heads: int, device: torch.device) -> int:
        return query_tile(num_heads, num_kv_heads, device)

    def rope_and_store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, rotary: RotaryEmbedding,
                       q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None
                       ) -> torch.Tensor:
        # One fused launch instead of q norm, k norm, RoPE and the store (batch-1 decode latency).
        return qk_norm_rope_store(positions, q, k, v, rotary.cos_sin, k_cache, v_cache,
                                  slot_mapping, *_norm_args(q_norm, k_norm))

    def attention(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, rotary: RotaryEmbedding, scale: float,
                  q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None
                  ) -> torch.Tensor:
        if meta.decode_only:
            num_sms = device_sm_count(q.device)
            splits = num_decode_splits(meta.num_seqs, k_cache.shape[2], meta.max_seq_len,
                                       num_sms)
            # A small batch is bound by the chain of dependent launches: the split kernel
            # finishes the new tokens itself, one launch fewer. Larger ones, split or not,
            # fill the GPU and their K/V loop runs better without that work's registers
            # (docs/kernels.md). 64-bit K/V offsets measured faster here, 32-bit ones (more
            # programs per SM) in large batches.
            if splits > 1 and meta.num_seqs <= LATENCY_MAX_SEQS:
                new = NewTokens(k, v, positions, meta.slot_mapping, rotary.cos_sin,
                                *_norm_args(q_norm, k_norm))
                tuning = split_decode_tuning(meta.num_seqs * k_cache.shape[2] * splits,
                                             meta.max_seq_len, splits, num_sms)
                return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                        meta.query_start_loc, meta.max_seq_len, scale,
                                        num_splits=splits, seq_order=meta.seq_order,
                                        new_tokens=new, tuning=tuning)
        q = self.rope_and_store(positions, q, k, v, k_cache, v_cache, meta.slot_mapping, rotary,
                                q_norm, k_norm)
        return self.attend(q, k_cache, v_cache, meta, scale)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.decode_only:
            fp8 = k_cache.dtype == torch.float8_e4m3fn
            return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, meta.max_seq_len, scale,
                                    seq_order=meta.seq_order,
                                    tuning=FP8_DECODE_TUNING if fp8 else DecodeTuning())
        return prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                 meta.query_start_loc, scale, work=meta.prefill_work)


def split_decode_tuning(programs: int, max_seq_len: int, splits: int, num_sms: int
                        ) -> DecodeTuning:
    """The split kernel's tuning for a launch of ``programs`` programs whose ``max_seq_len``
    keys go into ``splits`` splits: one stage when a split is at most one tile, but only with
    the tile read before the wait (one stage without it measured slower than three),
    and that only while the launch fits the device at three programs per SM."""
    if programs > PREFETCH_PROGRAMS_PER_SM * num_sms:
        return SPLIT_DECODE_TUNING._replace(prefetch_kv=False)
    tiles = -(-max_seq_len // SPLIT_DECODE_TUNING.block_n)
    return ONE_TILE_SPLIT_TUNING if tiles <= splits else SPLIT_DECODE_TUNING


def _norm_args(q_norm: RMSNorm | None, k_norm: RMSNorm | None) -> tuple:
    """The kernels' trailing norm arguments: (q weight, k weight, eps), or none without norms."""
    return () if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
