"""MXFP4 (OCP microscaling): blocks of 32 fp4 e2m1 values, two a byte (the even one in the low
nibble), sharing one e8m0 scale (2^(s - 127)). GPT-OSS checkpoints hold their experts so:
``<name>_blocks`` ``[E, out, in / 32, 16]`` and ``<name>_scales`` ``[E, out, in / 32]``."""
from __future__ import annotations

import torch

# e2m1: sign, two exponent bits, one mantissa bit.
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_half(name: str) -> tuple[str, str] | None:
    """``(<name>, "blocks" | "scales")`` for a checkpoint tensor that is half of an MXFP4
    projection (``..._proj_blocks``, ``..._proj_scales``), else None."""
    base, _, half = name.rpartition("_")
    return (base, half) if half in ("blocks", "scales") and base.endswith("_proj") else None


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[..., out, in]`` float32 (exact) from ``blocks`` ``[..., out, in / 32, 16]`` and
    ``scales`` ``[..., out, in / 32]`` (uint8), an expert at a time (bounded memory)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() < 3 or \
            blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks [..., G, 16] and scales [..., G] of uint8 expected, got "
                         f"{tuple(blocks.shape)} {blocks.dtype} and {tuple(scales.shape)} "
                         f"{scales.dtype}")
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    *lead, rows, groups, _ = blocks.shape
    blocks, scales = blocks.reshape(-1, rows, groups, 16), scales.reshape(-1, rows, groups)
    out = torch.empty(blocks.shape[0], rows, groups * 32, dtype=torch.float32)
    for i in range(blocks.shape[0]):
        codes = blocks[i].to(torch.int32)
        values = torch.stack([lut[codes & 15], lut[codes >> 4]], -1).flatten(-2)
        exponent = scales[i].to(torch.int32)[..., None] - 127
        out[i] = torch.ldexp(values, exponent).flatten(-2)
    return out.view(*lead, rows, groups * 32)
