"""Reference attention in plain PyTorch: gathers pages into padded tensors, masks, attends."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

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
    """Causal attention of packed queries over paged keys.
    ``window`` > 0: a query sees only the last ``window`` positions (itself included);
    ``softcap`` > 0: scores become ``softcap * tanh(scores / softcap)`` before the mask;
    ``sinks`` ([H], GPT-OSS): one more logit per head in each softmax, attached to no value.
    Sequences are attended in groups of like query count and context length, each group on
    padded dense tensors, so that one long prompt does not pad a batch of decodes to its size."""
    out = q.new_empty(q.shape[:-1] + v_cache.shape[-1:])  # MLA's values are narrower
    starts = meta.query_start_loc.tolist()
    q_lens = [end - start for start, end in zip(starts, starts[1:])]
    for rows in _like_sequences(q_lens, meta.seq_lens.tolist()):
        if not q_lens[rows[0]]:  # sequences with no new token this step
            continue
        index = torch.tensor(rows, device=q.device)
        tokens = torch.cat([torch.arange(starts[r], starts[r + 1], device=q.device)
                            for r in rows])
        out[tokens] = _attend_group(
            q, k_cache, v_cache, meta.query_start_loc[index].long(),
            torch.tensor([q_lens[r] for r in rows], device=q.device),
            meta.seq_lens[index].long(), meta.block_tables[index].long(),
            scale, window, softcap, sinks)
    return out


def _like_sequences(q_lens: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Batch rows grouped by query count and by context length within a factor of two."""
    groups: dict[tuple[int, int], list[int]] = {}
    for row, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        groups.setdefault((q_len, max(seq_len - 1, 0).bit_length()), []).append(row)
    return list(groups.values())


def _attend_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  starts: torch.Tensor, q_lens: torch.Tensor, seq_lens: torch.Tensor,
                  block_tables: torch.Tensor, scale: float, window: int, softcap: float,
                  sinks: torch.Tensor | None) -> torch.Tensor:
    """One group's attention on padded tensors; returns its queries' outputs, packed."""
    device = q.device
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    batch, max_q, max_kv = len(starts), int(q_lens.max()), int(seq_lens.max())

    q_pos = torch.arange(max_q, device=device)
    q_valid = q_pos[None, :] < q_lens[:, None]
    q_pad = q[torch.where(q_valid, starts[:, None] + q_pos[None, :], 0)]  # [B, max_q, H, D]
    kv_pos = torch.arange(max_kv, device=device)
    # Whole blocks copied (index_select of rows, not an index per key): [B, Hkv, max_kv, D].
    blocks = block_tables[:, :-(-max_kv // block_size)].reshape(-1)
    acc = torch.promote_types(q.dtype, torch.float32)  # float64 inputs stay float64

    def gather(cache: torch.Tensor) -> torch.Tensor:
        # Into a given tensor: PyTorch's CPU index_select is several times faster with out=.
        pages = cache.new_empty((len(blocks),) + cache.shape[1:])
        torch.index_select(cache, 0, blocks, out=pages)
        pages = pages.view(batch, -1, num_kv_heads, cache.shape[-1])  # MLA: v narrower
        return pages[:, :max_kv].to(acc).transpose(1, 2)

    k_pad, v_pad = gather(k_cache), gather(v_cache)

    # Query j of sequence i sits at absolute position (seq_len - q_len + j).
    q_abs = (seq_lens - q_lens)[:, None] + q_pos[None, :]
    mask = (kv_pos[None, None, :] <= q_abs[:, :, None]) & (kv_pos[None, None, :] < seq_lens[:, None, None])
    if window > 0:
        mask &= kv_pos[None, None, :] > q_abs[:, :, None] - window
    qh = q_pad.to(acc).transpose(1, 2)  # [B, H, max_q, D]
    if softcap <= 0 and sinks is None:
        out = F.scaled_dot_product_attention(qh, k_pad, v_pad, attn_mask=mask[:, None],
                                             scale=scale, enable_gqa=group > 1)
    else:
        # Heads of one KV head side by side in the query dimension: no copies of K and V.
        qg = qh.reshape(batch, num_kv_heads, group * max_q, head_dim)
        scores = torch.matmul(qg, k_pad.transpose(-1, -2)).mul_(scale)
        scores = scores.view(batch, num_kv_heads, group, max_q, max_kv)
        if softcap > 0:
            scores = scores.div_(softcap).tanh_().mul_(softcap)
        scores.masked_fill_(~mask[:, None, None], float("-inf"))
        if sinks is not None:
            sink = sinks.to(acc).view(1, num_kv_heads, group, 1, 1)
            top = torch.maximum(scores.amax(-1, keepdim=True), sink)
            probs = (scores - top).exp_()
            probs /= probs.sum(-1, keepdim=True) + (sink - top).exp()
        else:
            probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs.view(batch, num_kv_heads, group * max_q, max_kv), v_pad)
        out = out.view(batch, num_heads, max_q, v_pad.shape[-1])
    if int(seq_lens.min()) == 0:  # a zero-length sequence has no keys: its output is zero
        out = out.nan_to_num(0.0)
    return out.transpose(1, 2)[q_valid].to(q.dtype)
