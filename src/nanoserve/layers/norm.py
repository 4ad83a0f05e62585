"""RMSNorm, optionally fused with the residual add before it, and the forms in which a
projection's output may reach it (a tensor, split-K partial sums, or already in the residual)."""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class PartialSums(NamedTuple):
    """A projection's output left as float32 partial sums over slices of its input features
    (``parts``: ``[S, rows, N]``), for the add + RMSNorm after it to add up in its own launch
    (split-K decode projections on CUDA, ``layers.split_k``)."""

    parts: torch.Tensor


class AddedToResidual(NamedTuple):
    """Stands for a projection's output that its kernel already added into the residual, in
    place (the batch-1 GEMV's epilogue, or cuBLAS's ``C`` at larger batches): the norm after it
    normalises the residual alone. ``sum_squares`` (float64 ``[rows]``), where the kernel also
    summed the updated residual's squares, spares the norm that pass."""

    sum_squares: torch.Tensor | None = None


class RowScale(NamedTuple):
    """The RMSNorm a projection left out of its product: row ``t`` of its output still needs
    multiplying by ``1 / sqrt(mean(rows[t]^2) + eps)``, the norm's statistic of the row it
    projected (``rows``: ``[T, H]``, the residual stream). The projection carries the norm's
    weight in its columns (``ColumnParallelLinear.fold_norm``), so that scale is all that is
    left of the norm; the kernel that reads the output applies it, one launch fewer."""

    rows: torch.Tensor
    eps: float


def row_scale_torch(x: torch.Tensor, scale: RowScale) -> torch.Tensor:
    """``x [T, ...]`` with each row multiplied by ``scale``'s factor in float32, rounded to
    ``x``'s dtype (the reference for the kernels that take a ``RowScale``)."""
    rows = scale.rows.float()
    factor = torch.rsqrt(rows.pow(2).mean(-1) + scale.eps)
    return (x.float() * factor.view(-1, *[1] * (x.dim() - 1))).to(x.dtype)


# What a projection hands the add + RMSNorm after it: its output, split-K partial sums, or the
# marker that it already added its output into the residual.
NormInput = torch.Tensor | PartialSums | AddedToResidual


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The PyTorch formula (CPU path and reference): float32 maths, rounded before the weight."""
    dtype = x.dtype
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype) * weight


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), out of place."""
    residual = x + residual
    return rms_norm_torch(residual, weight, eps), residual


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32.

    With a residual it returns (norm(x + residual), x + residual); on CUDA the sum is written
    into ``residual`` in place, so callers must not reuse the tensor they passed.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        # True once the projection that reads this norm's output carries the weight in its own
        # columns (``ColumnParallelLinear.fold_norm``); the weight is then all ones.
        self.folded = False

    def forward(self, x: NormInput, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if isinstance(x, AddedToResidual):
            return self(residual), residual
        if isinstance(x, PartialSums):  # only produced on CUDA, always before a residual add
            from nanoserve.kernels.fused_ops import add_rms_norm_parts
            return add_rms_norm_parts(x.parts, residual, self.weight, self.eps)
        if x.is_cuda:  # one fused Triton kernel instead of ~8 elementwise launches
            from nanoserve.kernels.fused_ops import add_rms_norm, rms_norm
            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return rms_norm_torch(x, self.weight, self.eps)
        return add_rms_norm_torch(x, residual, self.weight, self.eps)
