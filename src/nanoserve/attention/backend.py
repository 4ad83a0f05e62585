"""The seam between model code and the device: how K/V are stored and attention is computed."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from nanoserve.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from nanoserve.layers.norm import RMSNorm
    from nanoserve.layers.rotary import RotaryEmbedding


class AttentionBackend(Protocol):
    """Stores new K/V into the paged cache and computes causal attention over it.

    Cache layout, per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and V.
    ``q`` is ``[T, num_heads, head_dim]``, ``k``/``v`` are ``[T, num_kv_heads, head_dim]``; the
    output is ``[T, num_heads, head_dim]``. Slots of -1 in the slot mapping are skipped.
    """

    def rope_and_store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, rotary: RotaryEmbedding,
                       q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None
                       ) -> torch.Tensor:
        """Per-head q/k norms (when given), RoPE, then the rotated k and v into the caches at
        ``slot_mapping`` (-1: not stored).

        Returns the rotated q for :meth:`attend`, possibly ``q`` itself modified in place.
        Whether ``k`` is rotated in place depends on the backend: do not use it afterwards.
        """

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor: ...


def select_backend(device: torch.device) -> AttentionBackend:
    """Pick the attention backend once, from the device the model runs on."""
    if device.type == "cuda":
        from nanoserve.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    from nanoserve.attention.torch_backend import TorchAttentionBackend
    return TorchAttentionBackend()
