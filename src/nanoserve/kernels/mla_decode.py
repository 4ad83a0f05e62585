"""Multi-head latent attention decode through the paged decode kernel. In the absorbed form a
DeepSeek layer's decode is multi-query attention: every head's query, taken through its key
up-projection into the latent space and joined by its rotated part, reads one shared KV
"head" of width kv_lora_rank + qk_rope_head_dim, the cached rows themselves, whose latent
part are also the values. So ``decode_attention`` runs it over the latent cache as K and V
(the rope part of the output dropped), and the value up-projection finishes each head.
Not yet wired into the Triton backend: its store, prefill and CUDA-graph paths are to come."""
from __future__ import annotations

import torch

from nanoserve.kernels.decode_attention import decode_attention


def mla_decode_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor,
                         query_start_loc: torch.Tensor, max_seq_len: int, kv_b: torch.Tensor,
                         v_head_dim: int, scale: float, num_splits: int | None = None,
                         seq_order: torch.Tensor | None = None) -> torch.Tensor:
    """``[T, H, v_head_dim]``, as ``mla_reference.mla_decode``: ``q_nope`` ``[T, H, nope]``,
    ``q_rope`` ``[T, H, rope]`` (rotated), ``cache`` ``[blocks, block_size, 1, rank + rope]``,
    ``kv_b`` ``[H * (nope + v_head_dim), rank]``; the rest as ``decode_attention``'s."""
    heads, nope = q_nope.shape[1], q_nope.shape[2]
    rank = cache.shape[-1] - q_rope.shape[-1]
    w = kv_b.view(heads, nope + v_head_dim, rank)
    q_latent = torch.einsum("thn,hnl->thl", q_nope, w[:, :nope])
    q = torch.cat([q_latent, q_rope], dim=-1).to(q_nope.dtype)
    out = decode_attention(q, cache, cache, block_tables, seq_lens, query_start_loc,
                           max_seq_len, scale, num_splits, seq_order=seq_order)
    return torch.einsum("thl,hvl->thv", out[..., :rank], w[:, nope:])
