"""Linear layers that shard themselves across tensor-parallel ranks.

Column-parallel layers split output features (no communication); row-parallel layers split
input features and all-reduce their partial sums. Fused QKV and merged gate/up layers are
column-parallel layers whose output is several checkpoint tensors stacked: each tensor's shard
goes in its own slot of the parameter.

Loading is two calls per checkpoint tensor: ``checkpoint_slice`` says which part of it this
rank needs (so the loader reads only that part from disk), ``weight_loader`` puts that part in
place. At size 1 the slice is the whole tensor and the forward is a plain ``F.linear``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.attention.backend import SplitPartials
from nanoserve.layers.activation import silu_and_mul
from nanoserve.layers.norm import AddedToResidual, NormInput, RMSNorm, RowScale
from nanoserve.layers.parallel_state import Narrow, divide, get_tp_group
from nanoserve.layers.split_k import split_k_partial_sums

ShardId = str | int | None

# From this many rows a projection before a folded norm adds into the residual itself
# (``RowParallelLinear.adds_into_residual``). Fewer keep split-K and the norm's launch: at 2-7
# rows cuBLAS's GEMM with beta = 1 lost to them by 4-25%, whether split decode then applied the
# row scale itself (run 187) or left the new tokens to a launch of their own (runs 180, 184;
# docs/kernels.md, "The pre-norms left to the kernels after the projections").
EPILOGUE_MIN_ROWS = 8


def _skinny_on_cuda(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Decode at batch 1 (or 2-4, for some shapes) on CUDA in 16 bits: the skinny-GEMM kernel's
    case, with the norms, the residual adds and SiLU-and-mul inside it."""
    if not (x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16)):
        return False
    from nanoserve.kernels.skinny_gemm import serves
    return serves(x.shape[0], *weight.shape)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           activate: bool = False) -> torch.Tensor:
    """``F.linear``; with ``activate``, ``silu(gate) * up`` of it (``weight`` being a merged
    ``[gate; up]``).

    One 16-bit row on CUDA (batch-1 decode) goes through the skinny-GEMM Triton kernel: as fast
    as cuBLAS or faster on every projection shape measured there, up to 3x on some
    (docs/kernels.md), and with ``activate`` it applies SiLU-and-mul as it stores, one launch
    less. So do two and four rows, for the shapes where that measured faster
    (``skinny_gemm.TUNED_FEW_ROWS``).
    """
    if _skinny_on_cuda(x, weight):
        from nanoserve.kernels.skinny_gemm import skinny_linear
        return skinny_linear(x, weight, bias, activate=activate)
    out = F.linear(x, weight, bias)
    return silu_and_mul(out) if activate else out


def norm_linear(x: NormInput, residual: torch.Tensor | None, norm: RMSNorm,
                weight: torch.Tensor, bias: torch.Tensor | None, activate: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, RowScale | None]:
    """``(linear(norm(x + residual)), x + residual, None)``; without a residual,
    ``(.. norm(x) .., x, None)``.

    Where the norm's weight is folded into ``weight`` (the GPU path) and the projection before
    already added its output into the residual (``AddedToResidual``), the norm needs no launch:
    at batch 1 (or 2 and 4), with the sums of squares that projection left (``sum_squares``),
    the skinny GEMV applies it; at larger batches the projection runs on the residual as it is
    and the norm's factor per row is left to the kernel that reads the product (the third item,
    a ``RowScale``; with ``activate`` the SiLU-and-mul launch applies it and the third item is
    None). Elsewhere this is the norm module (which takes every form of ``x``), then
    :func:`linear`.
    """
    if norm.folded and isinstance(x, AddedToResidual):
        if x.sum_squares is not None:
            from nanoserve.kernels.skinny_gemm import skinny_rms_linear
            return skinny_rms_linear(residual, x.sum_squares, norm.eps, weight, bias,
                                     activate=activate), residual, None
        if bias is None:
            scale = RowScale(residual, norm.eps)
            out = linear(residual, weight, None)
            if activate:
                return silu_and_mul(out, scale), residual, None
            return out, residual, scale
    if residual is None:
        return linear(norm(x), weight, bias, activate=activate), x, None
    normed, residual = norm(x, residual)
    return linear(normed, weight, bias, activate=activate), residual, None


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

    def checkpoint_slice(self, param: nn.Parameter, shard_id: ShardId = None) -> Narrow | None:
        size = param.shape[0]
        return Narrow(0, self.tp.rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def forward_normed(self, x: NormInput, residual: torch.Tensor | None, norm: RMSNorm,
                       activate: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, RowScale | None]:
        """``forward(norm(x + residual))``, the summed residual, and the row scale the output
        still needs, if any (:func:`norm_linear`); with ``activate`` (a merged ``[gate; up]``
        projection), ``silu_and_mul`` of it."""
        return norm_linear(x, residual, norm, self.weight, self.bias, activate)

    @torch.no_grad()
    def fold_norm(self, norm: RMSNorm) -> None:
        """Carry ``norm``'s weight in this projection's columns (``W[:, k] * g[k]``, computed
        in float32) and set the norm's weight to ones: the same product, with the weight
        multiply done once at load time. The batch-1 GEMV then applies the norm itself
        (:func:`norm_linear`)."""
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
        """(offset, size) of checkpoint tensor ``shard_id``'s shard in this rank's parameter."""
        sizes = [divide(s, self.tp.size, "output features") for s in self.out_sizes]
        index = int(shard_id)
        return sum(sizes[:index]), sizes[index]

    def checkpoint_slice(self, param: nn.Parameter, shard_id: ShardId = None) -> Narrow | None:
        size = self._slot(shard_id)[1]
        return Narrow(0, self.tp.rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        offset, size = self._slot(shard_id)
        param.data.narrow(0, offset, size).copy_(loaded)


class QKVParallelLinear(MergedColumnParallelLinear):
    """Fused q/k/v projection split by heads; KV heads are replicated when ranks outnumber them.

    Each rank holds ``num_heads / tp`` query heads and the KV heads they attend with: its own
    ``num_kv_heads / tp`` heads, or, with fewer KV heads than ranks, a copy of the one head
    that its query heads share (``tp / num_kv_heads`` consecutive ranks hold the same head).
    """

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
    """y = x W^T + b with W's columns (input features) split; partial sums all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.tp = get_tp_group()
        self.in_per_rank = divide(in_features, self.tp.size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) \
            if bias else None
        # float64 [skinny_gemm.MAX_ROWS], zeroed before each forward, where the skinny GEMV sums
        # the squares of the residual rows it updates, for the norm after it
        # (``DecoderModel.track_sum_squares``).
        self.sum_squares: torch.Tensor | None = None
        # Set where the projection after the next norm carries that norm's weight and takes its
        # row scale (``DecoderForCausalLM.fold_norm_weights``): then, from EPILOGUE_MIN_ROWS
        # rows, the GEMM adds its output into the residual itself and the norm has nothing to do.
        self.adds_into_residual = False

    def checkpoint_slice(self, param: nn.Parameter, shard_id: ShardId = None) -> Narrow | None:
        if param.dim() == 1:  # the bias is whole on every rank
            return None
        size = param.shape[1]
        return Narrow(1, self.tp.rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        if param.dim() == 1 and self.tp.rank > 0:
            param.data.zero_()  # the all-reduce sums the ranks: the bias is added on rank 0 only
            return
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(linear(x, self.weight, self.bias))

    def _sum_squares(self, rows: int) -> torch.Tensor | None:
        """The slots of :attr:`sum_squares` for a batch of ``rows`` rows, if it is tracked."""
        return None if self.sum_squares is None else self.sum_squares[:rows]

    @property
    def merges_split_partials(self) -> bool:
        """Whether :meth:`forward_for_norm` takes a batch-1 attention output still split
        (``SplitPartials``): on one rank, on CUDA, in 16 bits, without bias, for a shape where
        that measured faster than merging first (``merged_o_proj.TUNED``)."""
        if not (self.tp.size == 1 and self.bias is None and self.weight.is_cuda
                and self.weight.dtype in (torch.bfloat16, torch.float16)):
            return False
        from nanoserve.kernels.merged_o_proj import TUNED
        return tuple(self.weight.shape) in TUNED

    def forward_for_norm(self, x: torch.Tensor | SplitPartials, residual: torch.Tensor
                         ) -> tuple[NormInput, torch.Tensor]:
        """:meth:`forward` for a caller that feeds the result and ``residual`` to an add +
        RMSNorm: on one rank the result may instead be split-K partial sums
        (``layers.split_k``) for the norm to add up, or, at batch 1 on CUDA (2 and 4 for some
        shapes), already added into ``residual`` in place by the GEMV's epilogue
        (``AddedToResidual``, with the updated rows' sums of squares where ``sum_squares`` is
        set), and likewise at larger batches (from ``EPILOGUE_MIN_ROWS`` rows) where
        :attr:`adds_into_residual` is set (cuBLAS's ``beta = 1``: one launch in place of the
        GEMM and the norm). ``x`` may be attention's split partials where
        :attr:`merges_split_partials` allows them; they are merged as they are read
        (``kernels/merged_o_proj.py``)."""
        if isinstance(x, SplitPartials):
            from nanoserve.kernels.merged_o_proj import merged_o_proj
            sums = self._sum_squares(1)
            merged_o_proj(x.lse, x.out, self.weight, residual, sums)
            return AddedToResidual(sums), residual
        if self.tp.size > 1:
            return self.forward(x), residual
        if (self.bias is None and _skinny_on_cuda(x, self.weight)
                and residual.dtype == x.dtype and residual.is_contiguous()):
            from nanoserve.kernels.skinny_gemm import skinny_linear
            sums = self._sum_squares(x.shape[0])
            skinny_linear(x, self.weight, residual=residual, sum_squares=sums)
            return AddedToResidual(sums), residual
        if (self.adds_into_residual and self.bias is None and x.dim() == 2
                and x.shape[0] >= EPILOGUE_MIN_ROWS):
            residual.addmm_(x, self.weight.t())
            return AddedToResidual(), residual
        parts = split_k_partial_sums(x, self.weight, self.bias)
        return (parts if parts is not None else linear(x, self.weight, self.bias)), residual
