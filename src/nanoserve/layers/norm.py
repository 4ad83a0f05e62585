"""RMSNorm: x / rms(x) * weight in float32."""
from __future__ import annotations

import torch
from torch import nn


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The PyTorch formula (CPU path and reference): float32 maths, rounded before the weight
    (none: a weight of ones)."""
    dtype = x.dtype
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return normed if weight is None else normed * weight


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32, over the last dimension."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        # True once the projection that reads this norm's output carries the weight in its own
        # columns (``ColumnParallelLinear.fold_norm``): what is left of the norm is each row's
        # 1 / rms, which that projection applies (``linear(..., norm_eps=)``).
        self.folded = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.folded else self.weight
        if x.is_cuda:  # one fused Triton kernel instead of ~8 elementwise launches
            from nanoserve.kernels.fused_ops import rms_norm
            return rms_norm(x, weight, self.eps)
        return rms_norm_torch(x, weight, self.eps)
