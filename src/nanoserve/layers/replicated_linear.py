"""A linear layer held whole on every tensor-parallel rank."""
from __future__ import annotations

import torch
from torch import nn

from nanoserve.layers.linear import ColumnParallelLinear, ShardId, _Linear
from nanoserve.layers.parallel_state import get_tp_group


class ReplicatedLinear(ColumnParallelLinear):
    """y = x W^T + b with all of W on each rank: MLA's down-projections, whose outputs every
    rank's heads read (the column-parallel loading, its one slice the whole tensor)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        _Linear.__init__(self)
        self.tp = get_tp_group()
        self.out_per_rank = out_features
        self._create(in_features, in_features, out_features, row_parallel=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) \
            if bias else None
        if self.bias is not None:
            self.bias.output_dim, self.bias.out_pack = 0, 1

    def _shard_index(self, shard_id: ShardId) -> int:
        return 0
