"""Which tensor-parallel rank this process is, and the collectives the layers need. Layers
read the group once, when built, so a process can hold models of different sizes side by side."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple
from collections.abc import Iterator

import torch
import torch.distributed as dist


class Narrow(NamedTuple):
    """The part of a checkpoint tensor that one rank loads: ``length`` entries of ``dim``."""

    dim: int
    start: int
    length: int


@dataclass(frozen=True)
class TensorParallelGroup:
    """Rank and size of this process in the default torch.distributed group (1: no traffic)."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """The ranks' ``x`` concatenated along the last dim, on rank 0; None on the others."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The smallest ``value`` any rank holds (NCCL reduces device tensors only)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


_group = TensorParallelGroup()


def divide(total: int, parts: int, what: str) -> int:
    """``total / parts``, or a clear error naming ``what`` when the ranks cannot share it."""
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({parts})")
    return total // parts


def get_tp_group() -> TensorParallelGroup:
    return _group


@contextmanager
def tensor_parallel_group(rank: int, size: int) -> Iterator[TensorParallelGroup]:
    """Layers built inside this block shard themselves as ``rank`` of ``size`` ranks."""
    global _group
    previous, _group = _group, TensorParallelGroup(rank, size)
    try:
        yield _group
    finally:
        _group = previous
