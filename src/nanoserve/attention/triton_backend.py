"""Attention backend for CUDA: Triton kernels for q/k norm + RoPE + KV store, decode and prefill."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nanoserve.attention.metadata import AttentionMetadata
from nanoserve.attention.mla_reference import mla_prefill
from nanoserve.kernels.common import device_sm_count
from nanoserve.kernels.decode_attention import (LATENCY_MAX_SEQS, DecodeTuning, NewTokens,
                                                decode_attention, num_decode_splits)
from nanoserve.kernels.mla_decode import mla_decode_attention, rope_store_latent
from nanoserve.kernels.prefill_attention import prefill_attention, query_tile
from nanoserve.kernels.qk_norm_rope import qk_norm_rope_store

if TYPE_CHECKING:
    from nanoserve.layers.norm import RMSNorm
    from nanoserve.layers.rotary import RotaryEmbedding


SPLIT_DECODE_TUNING = DecodeTuning(narrow_offsets=False, prefetch_kv=True)
# A split of one tile has nothing to pipeline: without stages the programs start sooner.
ONE_TILE_SPLIT_TUNING = SPLIT_DECODE_TUNING._replace(num_stages=1)
# The prefetched tile costs registers: launches larger than this many programs per SM skip it.
PREFETCH_PROGRAMS_PER_SM = 3
# An fp8 cache's K/V are read faster by two warps per program than by four.
FP8_DECODE_TUNING = DecodeTuning(num_warps=2)


class TritonAttentionBackend:
    """GPU path: flash-decoding for decode-only batches (no host reads: CUDA-graph capturable),
    paged varlen prefill for the rest."""

    def prefill_tile(self, num_heads: int, num_kv_heads: int, device: torch.device) -> int:
        return query_tile(num_heads, num_kv_heads, device)

    def rope_and_store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, rotary: RotaryEmbedding,
                       q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None
                       ) -> torch.Tensor:
        if rotary.partial:
            # The fused kernels rotate whole heads: norms and RoPE unfused, then the kernel
            # with a table that rotates nothing stores k and v (no host sync: graph-safe).
            if q_norm is not None:
                q, k = q_norm(q), k_norm(k)
            q, k = rotary(positions, q, k)
            return qk_norm_rope_store(torch.zeros_like(positions), q, k, v, rotary.identity,
                                      k_cache, v_cache, slot_mapping)
        # One fused launch instead of q norm, k norm, RoPE and the store.
        return qk_norm_rope_store(positions, q, k, v, rotary.cos_sin, k_cache, v_cache,
                                  slot_mapping, *_norm_args(q_norm, k_norm))

    def attention(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, rotary: RotaryEmbedding, scale: float,
                  q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
                  window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None
                  ) -> torch.Tensor:
        if meta.decode_only and not rotary.partial:
            num_sms = device_sm_count(q.device)
            splits = num_decode_splits(meta.num_seqs, k_cache.shape[2], meta.max_seq_len,
                                       num_sms)
            # Small batches are launch-bound: the split kernel finishes the new tokens itself.
            fused = meta.num_seqs <= LATENCY_MAX_SEQS and not meta.rows_share_sequences
            if splits > 1 and fused:
                new = NewTokens(k, v, positions, meta.slot_mapping, rotary.cos_sin,
                                *_norm_args(q_norm, k_norm))
                tuning = split_decode_tuning(meta.num_seqs * k_cache.shape[2] * splits,
                                             meta.max_seq_len, splits, num_sms)
                return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                        meta.query_start_loc, meta.max_seq_len, scale,
                                        num_splits=splits, seq_order=meta.seq_order,
                                        new_tokens=new, tuning=tuning, window=window,
                                        softcap=softcap, sinks=sinks)
        q = self.rope_and_store(positions, q, k, v, k_cache, v_cache, meta.slot_mapping, rotary,
                                q_norm, k_norm)
        return self.attend(q, k_cache, v_cache, meta, scale, window, softcap, sinks)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        if meta.decode_only:
            fp8 = k_cache.dtype == torch.float8_e4m3fn
            return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, meta.max_seq_len, scale,
                                    seq_order=meta.seq_order,
                                    tuning=FP8_DECODE_TUNING if fp8 else DecodeTuning(),
                                    window=window, softcap=softcap, sinks=sinks)
        return prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                 meta.query_start_loc, scale, work=meta.prefill_work,
                                 window=window, softcap=softcap, sinks=sinks)

    def mla_attention(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                      cos_sin: torch.Tensor, latent_norm: RMSNorm, cache: torch.Tensor,
                      meta: AttentionMetadata, kv_b: torch.Tensor, v_head_dim: int,
                      scale: float) -> torch.Tensor:
        """Multi-head latent attention from the projections' outputs, as the PyTorch
        backend's: one kernel rotates and stores; decode in the absorbed form through the
        latent split kernel (both graph-safe), other steps over the decompressed keys and
        values of the blocks they read, in PyTorch."""
        nope = q.shape[-1] - cos_sin.shape[-1]
        q_rope = rope_store_latent(q, kv, positions, cos_sin, latent_norm.weight,
                                   latent_norm.eps, cache, meta.slot_mapping)
        if not meta.decode_only:
            return mla_prefill(q[..., :nope], q_rope, cache, meta, kv_b, v_head_dim, scale)
        return mla_decode_attention(q[..., :nope], q_rope, cache, meta.block_tables,
                                    meta.seq_lens, meta.query_start_loc, meta.max_seq_len, kv_b,
                                    v_head_dim, scale, seq_order=meta.seq_order)


def split_decode_tuning(programs: int, max_seq_len: int, splits: int, num_sms: int
                        ) -> DecodeTuning:
    """The split kernel's tuning: the prefetch only within ``PREFETCH_PROGRAMS_PER_SM``, and
    then one stage where a split is at most one tile."""
    if programs > PREFETCH_PROGRAMS_PER_SM * num_sms:
        return SPLIT_DECODE_TUNING._replace(prefetch_kv=False)
    tiles = -(-max_seq_len // SPLIT_DECODE_TUNING.block_n)
    return ONE_TILE_SPLIT_TUNING if tiles <= splits else SPLIT_DECODE_TUNING


def _norm_args(q_norm: RMSNorm | None, k_norm: RMSNorm | None) -> tuple:
    """The kernels' trailing norm arguments: (q weight, k weight, eps), or none without norms."""
    return () if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
