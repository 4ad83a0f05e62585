"""Reference attention in plain PyTorch: pages gathered (or read in place) into padded tensors,
masked where a query does not see every key, attended."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from nanoserve.attention.metadata import AttentionMetadata
from nanoserve.attention.torch_plan import AttentionPlan, GroupPlan, cast, plan_attention

if TYPE_CHECKING:
    from nanoserve.layers.norm import RMSNorm
    from nanoserve.layers.rotary import RotaryEmbedding


class TorchAttentionBackend:
    """CPU path and the reference for the Triton kernels: exact, vectorised, no custom ops.
    The batch's layout is worked out once per forward (``torch_plan.py``), at its first layer."""

    def __init__(self) -> None:
        # The latest layouts: a forward has one per cache group's metadata.
        self._plans: list[tuple[AttentionMetadata, int, AttentionPlan]] = []

    def plan(self, meta: AttentionMetadata, block_size: int) -> AttentionPlan:
        """``meta``'s layout, made at the first layer that reads it (metadata is not changed
        during a forward)."""
        for known, size, plan in self._plans:
            if known is meta and size == block_size:
                return plan
        self._plans = self._plans[-15:] + [(meta, block_size, plan_attention(meta, block_size))]
        return self._plans[-1][2]

    def prefill_tile(self, num_heads: int, num_kv_heads: int, head_dim: int,
                     device: torch.device) -> int:
        return 0  # attends sequence by sequence: no work list

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 plan: AttentionPlan | None = None) -> None:
        """K and V into their slots (-1: not stored); ``plan`` has the valid slots found."""
        if plan is None:
            valid = slot_mapping >= 0
            slots = slot_mapping[valid]
        else:
            valid, slots = plan.valid, plan.slots
        if valid is not None:
            k, v = k[valid], v[valid]
        num_kv_heads, head_dim = k_cache.shape[-2:]
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = cast(k, k_cache.dtype)
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = cast(v, v_cache.dtype)

    def rope_and_store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, rotary: RotaryEmbedding,
                       q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
                       plan: AttentionPlan | None = None) -> torch.Tensor:
        """The norm and rotary modules, then :meth:`store_kv`: the unfused reference."""
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        q, k = rotary(positions, q, k, None if plan is None else
                      plan.rope_rows(rotary.cos_sin, positions))
        self.store_kv(k, v, k_cache, v_cache, slot_mapping, plan)
        return q

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        return paged_attention_reference(q, k_cache, v_cache, meta, scale, window, softcap,
                                         sinks, self.plan(meta, k_cache.shape[1]))

    def attention(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, rotary: RotaryEmbedding, scale: float,
                  q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
                  window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None
                  ) -> torch.Tensor:
        """The unfused sequence."""
        plan = self.plan(meta, k_cache.shape[1])
        q = self.rope_and_store(positions, q, k, v, k_cache, v_cache, meta.slot_mapping, rotary,
                                q_norm, k_norm, plan)
        return paged_attention_reference(q, k_cache, v_cache, meta, scale, window, softcap,
                                         sinks, plan)

    def mla_attention(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                      cos_sin: torch.Tensor, latent_norm: RMSNorm, cache: torch.Tensor,
                      meta: AttentionMetadata, kv_b: torch.Tensor, v_head_dim: int,
                      scale: float) -> torch.Tensor:
        """Multi-head latent attention from the projections' outputs (``q`` ``[T, H, nope +
        rope]``, ``kv`` ``[T, rank + rope]``): rotated and normed, the latent rows stored, then
        decode steps in the absorbed form, others over decompressed keys and values."""
        from nanoserve.attention import mla_reference as mla

        q_nope, q_rope, latent, k_rope = mla.rope_and_norm(q, kv, positions, cos_sin,
                                                           latent_norm)
        mla.store_latent(latent, k_rope, cache, meta.slot_mapping)
        run = mla.mla_decode if meta.decode_only else mla.mla_prefill
        return run(q_nope, q_rope, cache, meta, kv_b, v_head_dim, scale)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float, window: int = 0,
                              softcap: float = 0.0, sinks: torch.Tensor | None = None,
                              plan: AttentionPlan | None = None) -> torch.Tensor:
    """Causal attention of packed queries over paged keys.
    ``window`` > 0: a query sees only the last ``window`` positions (itself included);
    ``softcap`` > 0: scores become ``softcap * tanh(scores / softcap)`` before the mask;
    ``sinks`` ([H], GPT-OSS): one more logit per head in each softmax, attached to no value.
    Sequences are attended in groups of like query count and context length, each group on
    padded dense tensors, so that one long prompt does not pad a batch of decodes to its size;
    ``plan``: the batch's layout (``torch_plan.py``), made from ``meta`` when not given."""
    plan = plan or plan_attention(meta, k_cache.shape[1])
    if len(plan.groups) == 1 and plan.groups[0].tokens is None:
        return _attend_group(q, k_cache, v_cache, plan.groups[0], scale, window, softcap, sinks)
    out = q.new_empty(q.shape[:-1] + v_cache.shape[-1:])  # MLA's values are narrower
    for group in plan.groups:  # sequences with no new token this step are in none
        out[group.tokens] = _attend_group(q, k_cache, v_cache, group, scale, window, softcap,
                                          sinks)
    return out


def _attend_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  group: GroupPlan, scale: float, window: int, softcap: float,
                  sinks: torch.Tensor | None) -> torch.Tensor:
    """One group's attention on padded tensors; returns its queries' outputs, packed."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    num_heads = q.shape[1]
    heads_per_kv = num_heads // num_kv_heads
    batch, max_q = group.batch, group.max_q
    acc = torch.promote_types(q.dtype, torch.float32)  # float64 inputs stay float64
    start, mask = group.visibility(window)
    k_pad, v_pad = group.keys(k_cache, start, acc), group.keys(v_cache, start, acc)
    qh = cast(group.queries(q), acc).transpose(1, 2)  # [B, H, max_q, D]
    if softcap <= 0 and sinks is None:
        out = F.scaled_dot_product_attention(qh, k_pad, v_pad,
                                             attn_mask=None if mask is None else mask[:, None],
                                             scale=scale, enable_gqa=heads_per_kv > 1)
    else:
        # Heads of one KV head side by side in the query dimension: no copies of K and V.
        keys = k_pad.shape[2]
        qg = qh.reshape(batch, num_kv_heads, heads_per_kv * max_q, head_dim)
        scores = torch.matmul(qg, k_pad.transpose(-1, -2)).mul_(scale)
        scores = scores.view(batch, num_kv_heads, heads_per_kv, max_q, keys)
        if softcap > 0:
            scores = scores.div_(softcap).tanh_().mul_(softcap)
        if mask is not None:
            scores.masked_fill_(~mask[:, None, None], float("-inf"))
        if sinks is not None:
            sink = sinks.to(acc).view(1, num_kv_heads, heads_per_kv, 1, 1)
            top = torch.maximum(scores.amax(-1, keepdim=True), sink)
            probs = (scores - top).exp_()
            probs /= probs.sum(-1, keepdim=True) + (sink - top).exp()
        else:
            probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs.view(batch, num_kv_heads, heads_per_kv * max_q, keys), v_pad)
        out = out.view(batch, num_heads, max_q, v_pad.shape[-1])
    if group.empty_context:  # a zero-length sequence has no keys: its output is zero
        out = out.nan_to_num(0.0)
    return cast(group.packed(out.transpose(1, 2)), q.dtype)
