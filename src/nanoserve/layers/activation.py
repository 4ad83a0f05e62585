"""Gated activations over a merged gate/up projection: SiLU (SwiGLU) and GELU (GeGLU)."""
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


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """gelu(gate) * up (Gemma's GeGLU with ``approximate="tanh"``), ``x`` = [gate | up]."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate=approximate) * up


# The config's hidden_act -> the gated activation over [gate | up]; None: silu, which the
# projection applies itself (``linear(..., activate=True)``).
GATED_ACTIVATIONS = {
    "silu": None, "swish": None,
    "gelu_pytorch_tanh": gelu_and_mul,
    "gelu": lambda x: gelu_and_mul(x, approximate="none"),
}
