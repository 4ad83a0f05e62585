"""Attention backend for CUDA: Triton kernels for the KV store, decode and prefill."""
from __future__ import annotations

import torch

from nanoserve.attention.metadata import AttentionMetadata
from nanoserve.kernels.decode_attention import decode_attention
from nanoserve.kernels.kv_store import store_kv
from nanoserve.kernels.prefill_attention import prefill_attention


class TritonAttentionBackend:
    """GPU path: flash-decoding for decode-only batches, paged varlen prefill for the rest.

    Nothing here reads device values on the host, so the decode path can be captured in a CUDA
    graph (run it once outside capture first, so Triton compiles its kernels). The decode split
    count is chosen from ``meta.max_seq_len`` at capture time and stays fixed in the graph; the
    kernel partitions each sequence's actual length at replay, so results stay correct for any
    length, but a graph captured with a short ``max_seq_len`` under-splits long contexts.
    """

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        store_kv(k, v, k_cache, v_cache, slot_mapping)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.decode_only:
            return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, meta.max_seq_len, scale)
        return prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                 meta.query_start_loc, meta.max_query_len, scale)
