"""A float64 PyTorch stack of dense decoder layers at batch 1, and a random step of it run
through the experimental persistent decode kernel (benchmarks/persistent_layers.py): shared
by its interpreter tests (tests/kernels) and its GPU tests (tests/gpu)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from persistent_layers import (  # noqa: E402
    DecodeStep,
    LayerTiles,
    LayerWeights,
    decode_layers,
)

EPS = 1e-6


def rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Stack:
    """Random weights of ``num_layers`` decoder layers, unfolded (for the reference) and in
    the kernel's layout."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int,
                 num_layers: int, qk_norm: bool, dtype: torch.dtype, device: str):
        def w(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, dtype=torch.float64) * scale)

        self.heads, self.kv_heads, self.head_dim, self.inter = heads, kv_heads, head_dim, inter
        qkv_n = (heads + 2 * kv_heads) * head_dim
        self.qkv = w(num_layers, qkv_n, hidden, scale=hidden ** -0.5)
        self.o = w(num_layers, hidden, heads * head_dim, scale=(heads * head_dim) ** -0.5)
        self.gate_up = w(num_layers, 2 * inter, hidden, scale=hidden ** -0.5)
        self.down = w(num_layers, hidden, inter, scale=inter ** -0.5)
        self.input_norm = 1 + 0.1 * w(num_layers, hidden)
        self.post_norm = 1 + 0.1 * w(num_layers, hidden)
        self.q_norm = 1 + 0.1 * w(num_layers, head_dim) if qk_norm else None
        self.k_norm = 1 + 0.1 * w(num_layers, head_dim) if qk_norm else None
        cast = dict(dtype=dtype, device=device)
        self.kernel = LayerWeights(
            qkv=(self.qkv * self.input_norm[:, None, :]).to(**cast).contiguous(),
            o=self.o.to(**cast).contiguous(),
            gate_up=(self.gate_up * self.post_norm[:, None, :]).to(**cast).contiguous(),
            down=self.down.to(**cast).contiguous(),
            q_norm=None if self.q_norm is None else self.q_norm.to(**cast),
            k_norm=None if self.k_norm is None else self.k_norm.to(**cast))

    def reference(self, h: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_table: torch.Tensor, seq_len: int, slot: int, cos: torch.Tensor,
                  sin: torch.Tensor, scale: float) -> torch.Tensor:
        """h after every layer; stores the new k/v into the (float64) caches."""
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        block_size = k_cache.shape[2]
        positions = torch.arange(seq_len)
        rows = block_table[positions // block_size].long() * block_size + positions % block_size
        for layer in range(self.qkv.shape[0]):
            qkv = (rms(h) * self.input_norm[layer]) @ self.qkv[layer].T
            q = qkv[:heads * d].view(heads, d)
            k = qkv[heads * d:(heads + kv_heads) * d].view(kv_heads, d)
            v = qkv[(heads + kv_heads) * d:].view(kv_heads, d)
            if self.q_norm is not None:
                q, k = rms(q) * self.q_norm[layer], rms(k) * self.k_norm[layer]
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            k_flat = k_cache[layer].view(-1, kv_heads, d)
            v_flat = v_cache[layer].view(-1, kv_heads, d)
            k_flat[slot], v_flat[slot] = k, v
            keys, values = k_flat[rows], v_flat[rows]  # [seq_len, Hkv, D]
            group = heads // kv_heads
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
            probs = torch.softmax(torch.einsum("hd,shd->hs", q, keys) * scale, dim=-1)
            attn = torch.einsum("hs,shd->hd", probs, values).reshape(-1)
            h = h + attn @ self.o[layer].T
            gate, up = ((rms(h) * self.post_norm[layer]) @ self.gate_up[layer].T).chunk(2)
            h = h + (torch.nn.functional.silu(gate) * up) @ self.down[layer].T
        return h


def run_case(seq_len: int, qk_norm: bool, tiles: LayerTiles, dtype: torch.dtype,
             device: str, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
             head_dim: int = 16, inter: int = 48, num_layers: int = 2, block_size: int = 4,
             persistent: bool | None = None) -> tuple[torch.Tensor, ...]:
    """(kernel h, reference h, kernel caches, reference caches) for one random step."""
    stack = Stack(hidden, heads, kv_heads, head_dim, inter, num_layers, qk_norm, dtype, device)
    num_blocks = math.ceil(seq_len / block_size) + 3
    k_ref = torch.randn(num_layers, num_blocks, block_size, kv_heads, head_dim,
                        dtype=torch.float64)
    v_ref = torch.randn_like(k_ref)
    # Out-of-order blocks; the new token's slot is the last position's.
    block_table = torch.randperm(num_blocks)[:math.ceil(seq_len / block_size)].to(torch.int32)
    last = seq_len - 1
    slot = int(block_table[last // block_size]) * block_size + last % block_size
    position = seq_len - 1 + 5  # positions need not equal the context length
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.arange(position + 8, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    h_ref = torch.randn(hidden, dtype=torch.float64)
    scale = head_dim ** -0.5
    cast = dict(dtype=dtype, device=device)
    h = h_ref.to(**cast)
    k_cache, v_cache = k_ref.to(**cast), v_ref.to(**cast)
    step = DecodeStep(block_table=block_table.to(device),
                      seq_len=torch.tensor([seq_len], dtype=torch.int32, device=device),
                      position=torch.tensor([position], device=device),
                      slot=torch.tensor([slot], device=device))
    sync = decode_layers(h, stack.kernel, k_cache, v_cache, step, cos_sin.to(**cast), EPS, EPS,
                         scale, tiles, persistent=persistent)
    assert int(sync[1]) == 0, "a barrier timed out"
    expected = stack.reference(h_ref, k_ref, v_ref, block_table, seq_len, slot,
                               cos_sin[position, :head_dim // 2],
                               cos_sin[position, head_dim // 2:], scale)
    return h, expected, (k_cache, v_cache), (k_ref, v_ref)


# Three programs for more tiles and attention items than that: every phase's tile loop runs.
SMALL_TILES = LayerTiles(qkv=16, o=8, gate_up=16, down=8, num_warps=1, attn_block_n=16,
                         num_splits=4, programs=3)
