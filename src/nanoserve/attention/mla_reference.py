"""Multi-head latent attention over a paged latent cache, in plain PyTorch (the CPU path and
the reference for any kernel). Each cached row is ``[latent | k_rope]``; ``kv_b`` is the
layer's ``[H * (nope + v), latent]`` up-projection, per head its key half then value half."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from nanoserve.attention.metadata import AttentionMetadata
from nanoserve.attention.torch_backend import paged_attention_reference
from nanoserve.layers.norm import RMSNorm
from nanoserve.layers.rotary import rotary_embedding_torch


def halves(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's RoPE rotates interleaved pairs (0, 1), (2, 3), ...: as even then odd
    features those are the half-split pairs the rotary formula rotates. q and k are permuted
    alike, so their dot products are DeepSeek's."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def rope_and_norm(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                  cos_sin: torch.Tensor, latent_norm: RMSNorm
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The projections' outputs made ready to attend and store: ``q`` ``[T, H, nope + rope]``
    and ``kv`` ``[T, rank + rope]`` (rope parts interleaved, rotated here by ``cos_sin``'s
    rows) give ``(q_nope, q_rope, normed latent, k_rope)``."""
    rope = cos_sin.shape[-1]
    q_nope, q_rope = q.split([q.shape[-1] - rope, rope], dim=-1)
    latent, k_rope = kv.split([kv.shape[-1] - rope, rope], dim=-1)
    q_rope, k_rope = rotary_embedding_torch(positions, halves(q_rope), halves(k_rope)[:, None],
                                            cos_sin)
    return q_nope, q_rope, latent_norm(latent), k_rope[:, 0]


def store_latent(latent: torch.Tensor, k_rope: torch.Tensor, cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Each token's ``[latent | k_rope]`` row into ``cache`` ``[blocks, block, 1, width]``."""
    valid = slot_mapping >= 0
    row = torch.cat([latent, k_rope], dim=-1)[valid]
    cache.view(-1, cache.shape[-1])[slot_mapping[valid]] = row.to(cache.dtype)


def mla_decode(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
               meta: AttentionMetadata, kv_b: torch.Tensor, v_head_dim: int, scale: float
               ) -> torch.Tensor:
    """The absorbed form: each head's ``q_nope`` taken through its key up-projection into the
    latent space, so scores read the cached rows as they are (one shared K of width
    latent + rope, values its latent part); the output leaves through the value half.
    ``q_nope`` ``[T, H, nope]``, ``q_rope`` ``[T, H, rope]``; returns ``[T, H, v]``."""
    heads, nope = q_nope.shape[1], q_nope.shape[2]
    rank = cache.shape[-1] - q_rope.shape[-1]
    w = kv_b.view(heads, nope + v_head_dim, rank)
    q_latent = torch.einsum("thn,hnl->thl", q_nope, w[:, :nope])
    out = paged_attention_reference(torch.cat([q_latent, q_rope], dim=-1), cache,
                                    cache[..., :rank], meta, scale)
    return torch.einsum("thl,hvl->thv", out, w[:, nope:])


def mla_prefill(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata, kv_b: torch.Tensor, v_head_dim: int, scale: float
                ) -> torch.Tensor:
    """Keys and values decompressed from the cached latents of the blocks this batch reads
    (only those), then ordinary attention over them; as :func:`mla_decode` otherwise."""
    heads, nope = q_nope.shape[1], q_nope.shape[2]
    rank = cache.shape[-1] - q_rope.shape[-1]
    used, tables = torch.unique(meta.block_tables, return_inverse=True)
    rows = cache[used, :, 0].to(q_nope.dtype)  # [U, block, latent + rope]
    kv = F.linear(rows[..., :rank], kv_b).view(*rows.shape[:2], heads, nope + v_head_dim)
    k_rope = rows[..., None, rank:].expand(-1, -1, heads, -1)
    keys = torch.cat([kv[..., :nope], k_rope], dim=-1)
    compact = dataclasses.replace(meta, block_tables=tables.to(meta.block_tables.dtype))
    return paged_attention_reference(torch.cat([q_nope, q_rope], dim=-1), keys,
                                     kv[..., nope:], compact, scale)
