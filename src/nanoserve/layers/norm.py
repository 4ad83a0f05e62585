"""RMSNorm: x / rms(x) * weight in float32."""
from __future__ import annotations

import torch
from torch import nn


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The PyTorch formula (CPU path and reference): float32, rounded before the weight."""
    dtype = x.dtype
    if dtype == torch.float32 and (weight is None or weight.dtype == torch.float32):
        return torch.rms_norm(x, x.shape[-1:], weight, eps)  # these steps, in one call
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return normed if weight is None else normed * weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm on ``x``'s device: on CUDA one fused Triton kernel instead of ~8 launches."""
    if x.is_cuda:
        from nanoserve.kernels.fused_ops import rms_norm as rms_norm_triton
        return rms_norm_triton(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32, over the last dimension."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        # Set by ``ColumnParallelLinear.fold_norm``: the reading projection applies the rest.
        self.folded = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, None if self.folded else self.weight, self.eps)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm, x / rms(x) * (1 + w): it holds 1 + w, added (in float32) as the
    checkpoint's w loads, so every kernel and weight fold that reads an RMSNorm reads it."""

    def checkpoint_slice(self, param: nn.Parameter, shard_id: object = None) -> None:
        return None  # replicated on every rank

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        param.data.copy_(loaded.float() + 1.0)
