"""Which device a runner uses, and the element types of its weights and of its KV cache."""
from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """``auto`` (CUDA when there is a GPU, else the CPU) or the named device, which must exist."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA device is available")
    return device


def resolve_kv_cache_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's element type: the model's (``auto``), or fp8 e4m3 (values stored as they
    are, without a scale: vLLM's default when a checkpoint has no calibrated scales)."""
    if name == "auto":
        return dtype
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"kv_cache_dtype {name!r} needs a GPU of compute capability 8.9 or "
                         "newer (Ada, Hopper, Blackwell), whose kernels convert to and from "
                         f"fp8; this one has {torch.cuda.get_device_capability(device)}")
    return torch.float8_e4m3fn


def resolve_dtype(name: str, model_dtype: str, device: torch.device) -> torch.dtype:
    """The weights' element type: the named one, or for ``auto`` float32 on the CPU and the
    checkpoint's 16-bit type (bfloat16 unless it is float16) on a GPU."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32  # CPU half-precision matmuls are slow and lossy
    return torch.float16 if model_dtype == "float16" else torch.bfloat16
