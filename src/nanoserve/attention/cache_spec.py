"""What one attention layer keeps per token in the paged KV cache: the model runner sizes and
allocates each layer's tensors from it, so a model whose layers store differently (MLA's one
latent row against K and V heads) needs no special case in the runner or block manager."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheSpec:
    """Per token: ``num_heads`` rows of ``head_dim`` values, in a key tensor and, with
    ``separate_values``, a value tensor of that shape; without, the values are read from the
    key tensor's rows (MLA's latent is both)."""

    num_heads: int
    head_dim: int
    separate_values: bool = True

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        return (num_blocks, block_size, self.num_heads, self.head_dim)

    def bytes_per_block(self, block_size: int, itemsize: int) -> int:
        tensors = 2 if self.separate_values else 1
        return tensors * block_size * self.num_heads * self.head_dim * itemsize
