"""Attention backend for CUDA: Triton kernels for q/k norm + RoPE + KV store, decode and prefill."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nanoserve.attention.metadata import AttentionMetadata
from nanoserve.attention.mla_reference import mla_prefill
from nanoserve.kernels.decode_attention import LATENCY_MAX_SEQS, NewTokens, decode_attention
from nanoserve.kernels.decode_attention import select as select_decode
from nanoserve.kernels.mla_decode import mla_decode_attention, rope_store_latent
from nanoserve.kernels.prefill_attention import prefill_attention, query_tile
from nanoserve.kernels.prefill_attention import select as select_prefill
from nanoserve.kernels.qk_norm_rope import qk_norm_rope_store

if TYPE_CHECKING:
    from nanoserve.layers.norm import RMSNorm
    from nanoserve.layers.rotary import RotaryEmbedding


class TritonAttentionBackend:
    """GPU path: flash-decoding for decode-only batches (no host reads: CUDA-graph capturable),
    paged varlen prefill for the rest."""

    def prefill_tile(self, num_heads: int, num_kv_heads: int, head_dim: int,
                     device: torch.device) -> int:
        # The config prefill_attention launches with for these heads: the same tile.
        return query_tile(num_heads, num_kv_heads,
                          select_prefill(num_heads, num_kv_heads, head_dim, device))

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
        # Small batches are launch-bound: where it splits, the decode kernel finishes the new
        # tokens itself (one launch fewer).
        if (meta.decode_only and not rotary.partial and not meta.rows_share_sequences
                and meta.num_seqs <= LATENCY_MAX_SEQS):
            tuning = select_decode(meta.num_seqs, q.shape[1], k_cache.shape[2], q.shape[2],
                                   meta.max_seq_len, k_cache.dtype, True, q.device)
            if tuning.num_splits > 1:
                new = NewTokens(k, v, positions, meta.slot_mapping, rotary.cos_sin,
                                *_norm_args(q_norm, k_norm))
                return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                        meta.query_start_loc, meta.max_seq_len, scale,
                                        seq_order=meta.seq_order, new_tokens=new,
                                        tuning=tuning, window=window, softcap=softcap,
                                        sinks=sinks)
        q = self.rope_and_store(positions, q, k, v, k_cache, v_cache, meta.slot_mapping, rotary,
                                q_norm, k_norm)
        return self.attend(q, k_cache, v_cache, meta, scale, window, softcap, sinks)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        if meta.decode_only:
            return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, meta.max_seq_len, scale,
                                    seq_order=meta.seq_order, window=window, softcap=softcap,
                                    sinks=sinks)
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


def _norm_args(q_norm: RMSNorm | None, k_norm: RMSNorm | None) -> tuple:
    """The kernels' trailing norm arguments: (q weight, k weight, eps), or none without norms."""
    return () if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
