"""Linear layers that shard themselves across tensor-parallel ranks: column-parallel ones split
output features (fused QKV and gate/up stack checkpoint tensors), row-parallel ones input
features. Loading is ``checkpoint_slice`` (the part this rank reads), then ``weight_loader``."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.layers.activation import silu_and_mul
from nanoserve.layers.norm import RMSNorm, rms_norm
from nanoserve.layers.parallel_state import Narrow, divide, get_tp_group

ShardId = str | int | None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           norm_eps: float | None = None, activate: bool = False,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with fusions. ``norm_eps``: the product of ``x / rms(x)``,
    the norm's weight folded into ``weight`` (``ColumnParallelLinear.fold_norm``); ``activate``:
    ``weight`` is ``[gate; up]``, the result ``silu(gate) * up``; ``residual``: the result is
    ``residual + product`` (on CUDA written into ``residual``). On CUDA in 16 bits, decode-sized
    batches go to the skinny GEMV where its ``select`` says so."""
    if x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16):
        from nanoserve.kernels import skinny_gemm
        config = skinny_gemm.select(x.shape[0], *weight.shape, x.device)
        if config is not None and (residual is None or residual.dtype == x.dtype):
            return skinny_gemm.skinny_linear(x, weight, bias, config, norm_eps=norm_eps,
                                             activate=activate, residual=residual)
    return unfused_linear(x, weight, bias, norm_eps=norm_eps, activate=activate,
                          residual=residual)


def unfused_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   norm_eps: float | None = None, activate: bool = False,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`linear` through ``F.linear``, each fusion a step of its own but the residual add,
    which the GEMM does (``beta = 1``) where it can."""
    if activate and residual is not None:
        raise ValueError("linear adds into a residual or activates, not both")
    if norm_eps is not None:
        x = rms_norm(x, None, norm_eps)
    if residual is None:
        out = F.linear(x, weight, bias)
        return silu_and_mul(out) if activate else out
    if x.is_cuda and bias is None and x.dim() == 2:
        return residual.addmm_(x, weight.t())
    return residual + F.linear(x, weight, bias)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's rows (output features) split across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.tp = get_tp_group()
        self.out_per_rank = divide(out_features, self.tp.size, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False) \
            if bias else None

    def _slot(self, shard_id: ShardId) -> tuple[int, int]:
        """(offset, size) of checkpoint tensor ``shard_id``'s shard in this rank's parameter."""
        return 0, self.out_per_rank

    def checkpoint_slice(self, param: nn.Parameter, shard_id: ShardId = None) -> Narrow | None:
        size = self._slot(shard_id)[1]
        return Narrow(0, self.tp.rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        offset, size = self._slot(shard_id)
        param.data.narrow(0, offset, size).copy_(loaded)

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None, activate: bool = False
                ) -> torch.Tensor:
        """``linear(norm(x))``, a folded norm applied by the op (``activate``: ``silu_and_mul``)."""
        if norm is not None and norm.folded:
            return linear(x, self.weight, self.bias, norm_eps=norm.eps, activate=activate)
        if norm is not None:
            x = norm(x)
        return linear(x, self.weight, self.bias, activate=activate)

    @torch.no_grad()
    def fold_norm(self, norm: RMSNorm) -> None:
        """Carry ``norm``'s weight in this projection's columns (``W[:, k] * g[k]``, in
        float32), leaving the norm each row's 1 / rms, which the projection op applies."""
        folded = self.weight.float() * norm.weight.float()[None, :]
        self.weight.copy_(folded.to(self.weight.dtype))
        norm.weight.fill_(1.0)
        norm.folded = True


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (e.g. gate and up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias)

    def _slot(self, shard_id: ShardId) -> tuple[int, int]:
        sizes = [divide(s, self.tp.size, "output features") for s in self.out_sizes]
        index = int(shard_id)
        return sum(sizes[:index]), sizes[index]


class QKVParallelLinear(MergedColumnParallelLinear):
    """Fused q/k/v projection split by heads; KV heads are replicated when ranks outnumber them
    (``tp / num_kv_heads`` consecutive ranks then hold a copy of the same head)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False):
        tp_size = get_tp_group().size
        self.num_heads = divide(num_heads, tp_size, "attention heads")
        if num_kv_heads >= tp_size:
            self.num_kv_heads = divide(num_kv_heads, tp_size, "KV heads")
        elif tp_size % num_kv_heads:
            raise ValueError(f"tensor_parallel_size ({tp_size}) must be a multiple of the "
                             f"KV heads ({num_kv_heads}) when it exceeds them")
        else:
            self.num_kv_heads = 1
        self.total_kv_heads = num_kv_heads
        self.head_dim = head_dim
        q_size, kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(hidden_size, [q_size * tp_size, kv_size * tp_size, kv_size * tp_size],
                         bias)

    def _slot(self, shard_id: ShardId) -> tuple[int, int]:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[
            shard_id]

    def checkpoint_slice(self, param: nn.Parameter, shard_id: ShardId = None) -> Narrow | None:
        size = self._slot(shard_id)[1]
        index = self.tp.rank
        if shard_id != "q" and self.total_kv_heads < self.tp.size:
            index = self.tp.rank * self.total_kv_heads // self.tp.size
        return Narrow(0, index * size, size)


class RowParallelLinear(nn.Module):
    """y = x W^T with W's columns (input features) split; partial sums all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.tp = get_tp_group()
        self.in_per_rank = divide(in_features, self.tp.size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank),
                                   requires_grad=False)
        # Replicated, added once after the reduce (GPT-OSS's o_proj).
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) \
            if bias else None

    def checkpoint_slice(self, param: nn.Parameter, shard_id: ShardId = None) -> Narrow | None:
        if param is self.bias:
            return None
        size = param.shape[1]
        return Narrow(1, self.tp.rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The all-reduced product; with ``residual``, ``residual`` plus it."""
        if self.tp.size == 1:
            return linear(x, self.weight, self.bias, residual=residual)
        out = self.tp.all_reduce(linear(x, self.weight))
        if self.bias is not None:
            out = out + self.bias
        return out if residual is None else residual + out
