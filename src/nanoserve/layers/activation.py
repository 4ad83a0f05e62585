"""SiLU-gated activation over a merged gate/up projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """The PyTorch formula (CPU path and reference)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, where ``x`` is [gate | up] along the last dimension."""
    if x.is_cuda:  # one Triton launch instead of three elementwise kernels
        from nanoserve.kernels.fused_ops import silu_and_mul as silu_and_mul_triton
        return silu_and_mul_triton(x)
    return silu_and_mul_torch(x)
