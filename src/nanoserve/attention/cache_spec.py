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


@dataclass(frozen=True)
class CacheGroups:
    """Which layers share a block table. Every group has its own table (block ids from the one
    pool) and a block id holds one block in each of ``num_slots`` tensors: slot ``s`` of the
    group owning the id. Layers whose windows differ sit in different groups, so a sliding
    layer's blocks can go back to the pool while a full layer's stay (vLLM's hybrid
    allocator): a model of ``L`` layers in ``G`` groups of ``L / G`` pays ``L / G`` layer
    blocks per block id, and a sequence holds only its window's in a sliding group."""

    windows: tuple[int, ...]  # per group: its layers' sliding window (0: full attention)
    layers: tuple[tuple[int, ...], ...]  # per group: its layers, slot by slot

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_slots(self) -> int:
        return max(len(layers) for layers in self.layers)


def cache_groups(layer_windows: list[int], hybrid: bool = True) -> CacheGroups:
    """Groups for layers with these windows: one for all when they agree (or ``hybrid`` is
    off: then every layer keeps every block of its sequence, a window's too); else, per window
    (full first), runs of as many layers as the least common window has."""
    kinds = sorted(set(layer_windows))
    if len(kinds) == 1 or not hybrid:
        window = kinds[0] if len(kinds) == 1 else 0
        return CacheGroups((window,), (tuple(range(len(layer_windows))),))
    by_kind = {w: [i for i, lw in enumerate(layer_windows) if lw == w] for w in kinds}
    size = min(len(layers) for layers in by_kind.values())
    windows, groups = [], []
    for w, layers in by_kind.items():
        for at in range(0, len(layers), size):
            windows.append(w)
            groups.append(tuple(layers[at:at + size]))
    return CacheGroups(tuple(windows), tuple(groups))
