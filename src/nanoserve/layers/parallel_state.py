"""Which tensor-parallel rank this process is, and the collective the layers need."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TensorParallelGroup:
    """Rank and size of this process in its tensor-parallel group (size 1: no communication)."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


_group = TensorParallelGroup()


def get_tp_group() -> TensorParallelGroup:
    return _group


def set_tp_group(rank: int, size: int) -> None:
    global _group
    _group = TensorParallelGroup(rank, size)
