"""SiLU-gated activation over a merged gate/up projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """The PyTorch formula (CPU path and reference)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """silu(gate) * up, where the input is [gate | up] along the last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from nanoserve.kernels.fused_ops import silu_and_mul
            return silu_and_mul(x)
        return silu_and_mul_torch(x)
