"""The seam between model code and the device: how K/V are stored and attention is computed."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from nanoserve.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from nanoserve.layers.norm import RMSNorm
    from nanoserve.layers.rotary import RotaryEmbedding


class AttentionBackend(Protocol):
    """Stores new K/V into the paged cache and computes causal attention over it. Per layer,
    K and V are ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    ``q`` is ``[T, num_heads, head_dim]``, ``k``/``v`` are ``[T, num_kv_heads, head_dim]``; the
    output is ``[T, num_heads, head_dim]``. Slots of -1 in the slot mapping are skipped.
    A backend that also has ``mla_attention`` (both do) runs multi-head latent
    attention over a one-row-per-token cache (``attention/mla_reference.py``); MLA layers
    refuse to be built on one without it.
    """

    def attention(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, rotary: RotaryEmbedding, scale: float,
                  q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
                  window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None
                  ) -> torch.Tensor:
        """Per-head q/k norms (when given) and RoPE on q and k; k and v into the caches at
        ``meta.slot_mapping``; then causal attention of q over the cache, each query seeing only
        the last ``window`` positions when ``window`` > 0, scores soft-capped to
        ``softcap * tanh(s / softcap)`` when ``softcap`` > 0, each head's softmax taking one
        more logit, ``sinks[head]``, attached to no value, when ``sinks`` is given. ``q``,
        ``k`` and ``v`` may be modified in place: do not use them afterwards."""

    def prefill_tile(self, num_heads: int, num_kv_heads: int, head_dim: int,
                     device: torch.device) -> int:
        """Tokens of a sequence per prefill program, for the runner to list the programs of a
        step that is not decode-only (``AttentionMetadata.prefill_work``); 0: no list needed."""


def select_backend(device: torch.device) -> AttentionBackend:
    """Pick the attention backend once, from the device the model runs on."""
    if device.type == "cuda":
        from nanoserve.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    from nanoserve.attention.torch_backend import TorchAttentionBackend
    return TorchAttentionBackend()
