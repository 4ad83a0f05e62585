"""Multi-head latent attention on the GPU: the latent store and decode through the paged decode
kernel. In the absorbed form a DeepSeek layer's decode is multi-query attention: every head's
query, taken through its key up-projection into the latent space and joined by its rotated
part, reads one shared KV "head" of width kv_lora_rank + qk_rope_head_dim, the cached rows
themselves, whose latent part are also the values. So ``decode_attention`` runs it over the
latent cache as K and V (the rope part of the output dropped), and the value up-projection
finishes each head. Prefill decompresses keys and values (``attention/mla_reference.py``)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.decode_attention import decode_attention


@triton.jit
def _store_latent_kernel(latent_ptr, k_rope_ptr, cache_ptr, slot_ptr, stride_latent,
                         stride_rope, RANK: tl.constexpr, ROPE: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding rows of a CUDA graph's batch
        return
    row = cache_ptr + slot * (RANK + ROPE)
    r = tl.arange(0, BLOCK_R)
    latent = tl.load(latent_ptr + token * stride_latent + r, mask=r < RANK)
    tl.store(row + r, latent.to(cache_ptr.dtype.element_ty), mask=r < RANK)
    p = tl.arange(0, BLOCK_P)
    k_rope = tl.load(k_rope_ptr + token * stride_rope + p, mask=p < ROPE)
    tl.store(row + RANK + p, k_rope.to(cache_ptr.dtype.element_ty), mask=p < ROPE)


def store_latent_rows(latent: torch.Tensor, k_rope: torch.Tensor, cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Each token's ``[latent | k_rope]`` row into ``cache`` ``[blocks, block, 1, width]`` at
    its slot, slots of -1 skipped: ``mla_reference.store_latent`` without its host sync, so
    that it runs inside CUDA graphs."""
    tokens, rank = latent.shape
    rope = k_rope.shape[-1]
    if cache.shape[-1] != rank + rope:
        raise ValueError(f"cache rows hold {cache.shape[-1]} values, not {rank} + {rope}")
    if tokens == 0:
        return
    latent = latent if latent.stride(-1) == 1 else latent.contiguous()
    k_rope = k_rope if k_rope.stride(-1) == 1 else k_rope.contiguous()
    _store_latent_kernel[(tokens,)](
        latent, k_rope, cache, slot_mapping, latent.stride(0), k_rope.stride(0), RANK=rank,
        ROPE=rope, BLOCK_R=triton.next_power_of_2(rank), BLOCK_P=triton.next_power_of_2(rope))


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
