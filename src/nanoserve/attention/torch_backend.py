"""Reference attention in plain PyTorch: gathers pages into padded tensors, masks, attends."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nanoserve.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from nanoserve.layers.norm import RMSNorm
    from nanoserve.layers.rotary import RotaryEmbedding


class TorchAttentionBackend:
    """CPU path and the reference for the Triton kernels: exact, vectorised, no custom ops."""

    def prefill_tile(self, num_heads: int, num_kv_heads: int, device: torch.device) -> int:
        return 0  # attends sequence by sequence: no work list

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        valid = slot_mapping >= 0
        slots = slot_mapping[valid]
        num_kv_heads, head_dim = k_cache.shape[-2:]
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = k[valid].to(k_cache.dtype)
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = v[valid].to(v_cache.dtype)

    def rope_and_store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, rotary: RotaryEmbedding,
                       q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None
                       ) -> torch.Tensor:
        """The norm and rotary modules, then :meth:`store_kv`: the unfused reference."""
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        q, k = rotary(positions, q, k)
        self.store_kv(k, v, k_cache, v_cache, slot_mapping)
        return q

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        return paged_attention_reference(q, k_cache, v_cache, meta, scale, window, softcap,
                                         sinks)

    def attention(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, rotary: RotaryEmbedding, scale: float,
                  q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
                  window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None
                  ) -> torch.Tensor:
        """The unfused sequence."""
        q = self.rope_and_store(positions, q, k, v, k_cache, v_cache, meta.slot_mapping, rotary,
                                q_norm, k_norm)
        return self.attend(q, k_cache, v_cache, meta, scale, window, softcap, sinks)

    def mla_attention(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                      k_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                      kv_b: torch.Tensor, v_head_dim: int, scale: float) -> torch.Tensor:
        """Multi-head latent attention (rotated inputs): the latent rows stored, then decode
        steps in the absorbed form, others over decompressed keys and values."""
        from nanoserve.attention import mla_reference as mla

        mla.store_latent(latent, k_rope, cache, meta.slot_mapping)
        run = mla.mla_decode if meta.decode_only else mla.mla_prefill
        return run(q_nope, q_rope, cache, meta, kv_b, v_head_dim, scale)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float, window: int = 0,
                              softcap: float = 0.0, sinks: torch.Tensor | None = None
                              ) -> torch.Tensor:
    """Causal attention of packed queries over paged keys, computed on padded dense tensors.
    ``window`` > 0: a query sees only the last ``window`` positions (itself included);
    ``softcap`` > 0: scores become ``softcap * tanh(scores / softcap)`` before the mask;
    ``sinks`` ([H], GPT-OSS): one more logit per head in each softmax, attached to no value."""
    device = q.device
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    starts = meta.query_start_loc[:-1].long()
    q_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()
    seq_lens = meta.seq_lens.long()
    max_q, max_kv = meta.max_query_len, meta.max_seq_len

    # Padded query view: [B, max_q] indices into the packed tokens.
    q_pos = torch.arange(max_q, device=device)
    q_valid = q_pos[None, :] < q_lens[:, None]
    q_index = torch.where(q_valid, starts[:, None] + q_pos[None, :], 0)
    q_pad = q[q_index]  # [B, max_q, H, D]

    # Padded keys gathered through the block tables: [B, max_kv, Hkv, D].
    kv_pos = torch.arange(max_kv, device=device)
    blocks = meta.block_tables.long()[:, kv_pos // block_size]
    slots = blocks * block_size + kv_pos % block_size
    k_pad = k_cache.view(-1, num_kv_heads, head_dim)[slots]
    v_pad = v_cache.reshape(-1, num_kv_heads, v_cache.shape[-1])[slots]  # MLA: v narrower

    # Query j of sequence i sits at absolute position (seq_len - q_len + j).
    q_abs = (seq_lens - q_lens)[:, None] + q_pos[None, :]
    mask = (kv_pos[None, None, :] <= q_abs[:, :, None]) & (kv_pos[None, None, :] < seq_lens[:, None, None])
    if window > 0:
        mask &= kv_pos[None, None, :] > q_abs[:, :, None] - window

    acc = torch.promote_types(q.dtype, torch.float32)  # float64 inputs stay float64
    qh = q_pad.permute(0, 2, 1, 3).to(acc)  # [B, H, max_q, D]
    kh = k_pad.permute(0, 2, 1, 3).to(acc).repeat_interleave(group, dim=1)
    vh = v_pad.permute(0, 2, 1, 3).to(acc).repeat_interleave(group, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    if sinks is not None:
        sink = sinks.to(acc).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a zero-length sequence has no keys
    out = torch.matmul(probs, vh).permute(0, 2, 1, 3)  # [B, max_q, H, D]
    return out[q_valid].to(q.dtype)
