"""Rotary position embeddings, half-split layout, over all of a head or its first ``rotary_dim``
features (partial rotary). Frequencies: default, linear and llama3 here; yarn, longrope and
dynamic from transformers' ``ROPE_INIT_FUNCTIONS``, their attention factor scaling cos and sin."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from nanoserve.hf_fields import SUPPORTED_ROPE_TYPES


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Per-pair inverse frequencies of the default, linear and llama3 rope types."""
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


def _transformers_rope(dim: int, max_positions: int, theta: float, scaling: dict[str, Any],
                       seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention factor) from transformers' own function for the rope type, given
    the config fields it reads; ``dim`` is the rotated width (partial rotary already applied)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {**scaling, "rope_theta": theta, "partial_rotary_factor": 1.0}
    config = SimpleNamespace(rope_parameters=params, head_dim=dim, hidden_size=dim,
                             num_attention_heads=1,
                             max_position_embeddings=max_positions,
                             standardize_rope_params=lambda: None)
    inv, factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, None, seq_len=seq_len)
    return inv.float(), float(factor)


def rope_cos_sin(dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None) -> torch.Tensor:
    """``[max_positions, dim]`` rows of ``[cos | sin]`` for positions 0, 1, ...

    longrope takes its short factors below ``original_max_position_embeddings`` and its long
    ones from there: transformers' choice for a sequence that never passes it (it re-rotates a
    whole sequence once it does, which a paged cache cannot); dynamic NTK equals the default
    frequencies below ``max_position_embeddings``, past which no sequence runs."""
    kind = "default" if scaling is None else scaling["rope_type"]
    positions = torch.arange(max_positions, dtype=torch.float32)
    factor = 1.0
    if kind in ("default", "linear", "llama3"):
        freqs = torch.outer(positions, rope_inv_freq(dim, theta, scaling))
    elif kind == "longrope":
        short, factor = _transformers_rope(dim, max_positions, theta, scaling)
        original = scaling["original_max_position_embeddings"]
        long, _ = _transformers_rope(dim, max_positions, theta, scaling, seq_len=original + 1)
        inv = torch.where(positions[:, None] < original, short[None, :], long[None, :])
        freqs = positions[:, None] * inv
    elif kind in SUPPORTED_ROPE_TYPES:
        inv, factor = _transformers_rope(dim, max_positions, theta, scaling)
        freqs = torch.outer(positions, inv)
    else:
        raise ValueError(f"rope type {kind!r} is not supported")
    cos, sin = freqs.cos(), freqs.sin()
    if factor != 1.0:  # transformers scales cos and sin, in float32, by the attention factor
        cos, sin = cos * factor, sin * factor
    return torch.cat([cos, sin], dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotates q and k by position (the first ``rotary_dim`` features of each head, default
    all); cos/sin tables are precomputed for every position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None, rotary_dim: int | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        # What the tables are made of: equal settings, equal tables.
        self.settings = (head_dim, self.rotary_dim, max_positions, float(theta),
                         json.dumps(scaling, sort_keys=True, default=str))
        self.register_buffer("cos_sin", rope_cos_sin(self.rotary_dim, max_positions, theta,
                                                     scaling), persistent=False)
        # One [cos | sin] row that rotates nothing: fused kernels then only store (partial).
        self.register_buffer("identity", torch.cat([torch.ones(1, head_dim // 2),
                                                    torch.zeros(1, head_dim // 2)], dim=-1),
                             persistent=False)

    @property
    def partial(self) -> bool:
        """Whether some features of each head pass unrotated (the fused kernels rotate all)."""
        return self.rotary_dim != self.head_dim

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                rows: RopeRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # The PyTorch backend's path; the Triton backend reads ``cos_sin`` in its own kernel.
        return rotary_embedding_torch(positions, q, k, self.cos_sin, rows)

    def same_as(self, other: RotaryEmbedding) -> bool:
        """Whether ``other`` rotates exactly as this one (layers may then share one)."""
        return self.settings == other.settings and self.cos_sin.device == other.cos_sin.device


RopeRows = tuple[torch.Tensor, torch.Tensor]  # per token: [cos | cos], [-sin | sin]


def rope_rows(cos_sin: torch.Tensor, positions: torch.Tensor) -> RopeRows:
    """``[T, 1, rotated]`` factors of x and of x with its halves swapped, for ``positions``:
    made once per forward and table, they serve every layer that shares the table."""
    cos, sin = cos_sin[positions].unsqueeze(-2).chunk(2, dim=-1)
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def rotary_embedding_torch(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           cos_sin: torch.Tensor, rows: RopeRows | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch formula (CPU path and reference): rotated copies of q and k, their first
    ``cos_sin.shape[-1]`` features rotated, the rest passed through; ``rows``: the
    positions' :func:`rope_rows`, when already made."""
    rows = rows or rope_rows(cos_sin, positions)
    return _rotate(q, rows), _rotate(k, rows)


def _rotate(x: torch.Tensor, rows: RopeRows) -> torch.Tensor:
    cos, sin = rows
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([_rotate(x[..., :rot], rows), x[..., rot:]], dim=-1)
    # [x1 * cos - x2 * sin, x2 * cos + x1 * sin] in float32, as transformers rounds it: adding
    # x2 * -sin is subtracting x2 * sin, bit for bit.
    xf = x.float()
    out = xf * cos + xf.roll(rot // 2, -1) * sin
    return out if out.dtype == x.dtype else out.to(x.dtype)  # .to costs a dispatch even so


def share_rotaries(attentions: list[nn.Module]) -> None:
    """Layers whose rotary tables are equal share one module: one table in memory, and the
    PyTorch backend makes each forward's factors once for all of them."""
    kept: list[RotaryEmbedding] = []
    for attn in attentions:
        same = next((r for r in kept if r.same_as(attn.rotary)), None)
        if same is None:
            kept.append(attn.rotary)
        else:
            attn.rotary = same
