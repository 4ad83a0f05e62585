"""Rotary position embeddings (default, linear and llama3 frequency scaling), half-split layout."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Per-pair inverse frequencies, rescaled as the config's rope type asks."""
    # float32 throughout, as transformers computes it, so positions rotate bit-identically.
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if scaling is None:
        return inv
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        mixed = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > old_len / low, inv / factor, inv)
        medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(medium, mixed, out)
    raise ValueError(f"rope type {kind!r} is not supported")


class RotaryEmbedding(nn.Module):
    """Rotates q and k by position; cos/sin tables are precomputed for every position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None):
        super().__init__()
        inv = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # The PyTorch backend's path; the Triton backend reads ``cos_sin`` in its own kernel.
        return rotary_embedding_torch(positions, q, k, self.cos_sin)


def rotary_embedding_torch(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch formula (CPU path and reference): rotated copies of q and k."""
    cos, sin = cos_sin[positions].unsqueeze(-2).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
