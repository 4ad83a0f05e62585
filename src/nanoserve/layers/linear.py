"""Linear layers that shard themselves across tensor-parallel ranks.

Column-parallel layers split output features (no communication); row-parallel layers split
input features and all-reduce their partial sums. Fused QKV and merged gate/up layers are
column-parallel layers whose output is several checkpoint tensors stacked: their weight loader
puts each tensor's shard in its slot.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.layers.parallel_state import get_tp_group


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({parts})")
    return total // parts


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's rows (output features) split across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.tp = get_tp_group()
        self.out_per_rank = _divide(out_features, self.tp.size, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False) \
            if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        size = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp.rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (e.g. gate and up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias)

    def _slot(self, shard_id: int) -> tuple[int, int]:
        sizes = [s // self.tp.size for s in self.out_sizes]
        return sum(sizes[:shard_id]), sizes[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        offset, size = self._slot(int(shard_id))
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp.rank * size, size))


class QKVParallelLinear(MergedColumnParallelLinear):
    """Fused q/k/v projection; KV heads are replicated when ranks outnumber them."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False):
        tp_size = get_tp_group().size
        self.num_heads = _divide(num_heads, tp_size, "attention heads")
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        if num_kv_heads >= tp_size:
            _divide(num_kv_heads, tp_size, "KV heads")
        elif tp_size % num_kv_heads:
            raise ValueError(f"tensor_parallel_size ({tp_size}) must be a multiple of the "
                             f"KV heads ({num_kv_heads}) when it exceeds them")
        self.total_kv_heads = num_kv_heads
        self.head_dim = head_dim
        kv_per_rank = self.num_kv_heads * head_dim
        super().__init__(hidden_size, [self.num_heads * head_dim * tp_size,
                                       kv_per_rank * tp_size, kv_per_rank * tp_size], bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, index = 0, q_size, self.tp.rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            # With replicated KV heads, consecutive ranks share one head.
            index = self.tp.rank * self.total_kv_heads // self.tp.size \
                if self.total_kv_heads < self.tp.size else self.tp.rank
            size = kv_size
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, index * size, size))


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's columns (input features) split; partial sums all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.tp = get_tp_group()
        self.in_per_rank = _divide(in_features, self.tp.size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) \
            if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        if param.dim() == 1:  # bias: added once, on rank 0
            param.data.copy_(loaded if self.tp.rank == 0 else torch.zeros_like(loaded))
            return
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp.rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(F.linear(x, self.weight, self.bias))
