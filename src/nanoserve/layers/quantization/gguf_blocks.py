"""GGUF's quantized blocks (ggml-quants.c's layouts) unpacked into codes, scales and offsets,
vectorised in PyTorch; ``codes * scale + offset`` is, bit for bit, what ggml dequantizes to."""
from __future__ import annotations

from collections.abc import Callable

import torch

from nanoserve.layers.quantization.packed import GroupedInts

QK_K = 256  # a K-quant super-block's values

Unpacked = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # codes, scales, offsets


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian half floats from pairs of bytes ``[..., 2]``, as float32 ``[...]``."""
    return b.contiguous().view(torch.float16).float().squeeze(-1)


def _nibbles(qs: torch.Tensor, n: int) -> torch.Tensor:
    """Bytes ``[..., m]`` -> ``[..., 2, m]``: the low nibbles, then the high ones."""
    return torch.stack([qs & 0x0F, qs >> 4], dim=-2)


def _q4_0(b: torch.Tensor) -> Unpacked:
    d = _f16(b[:, :2])[:, None]
    codes = _nibbles(b[:, 2:], 2).reshape(-1, 32)
    return codes, d, -8 * d


def _q4_1(b: torch.Tensor) -> Unpacked:
    d, m = _f16(b[:, :2])[:, None], _f16(b[:, 2:4])[:, None]
    return _nibbles(b[:, 4:], 2).reshape(-1, 32), d, m


def _q8_0(b: torch.Tensor) -> Unpacked:
    return b[:, 2:].contiguous().view(torch.int8), _f16(b[:, :2])[:, None], None


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the super-block's scale and min (``d * sc``, ``dmin * m``) of its eight
    sub-blocks, unpacked from 12 bytes of 6-bit values."""
    d, dmin = _f16(b[:, :2])[:, None], _f16(b[:, 2:4])[:, None]
    s = b[:, 4:16].reshape(-1, 3, 4)
    lo, hi, mix = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], dim=-1)
    m = torch.cat([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], dim=-1)
    return d * sc.float(), dmin * m.float()


def _q4_k(b: torch.Tensor) -> Unpacked:
    scale, low = _k_scales(b)
    codes = _nibbles(b[:, 16:].reshape(-1, 4, 32), 2).reshape(-1, QK_K)
    return codes, scale, -low


def _q5_k(b: torch.Tensor) -> Unpacked:
    scale, low = _k_scales(b)
    ql = _nibbles(b[:, 48:].reshape(-1, 4, 32), 2).reshape(-1, 8, 32)
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)[None, :, None]
    qh = (b[:, 16:48][:, None, :] >> shifts) & 1
    return (ql | (qh << 4)).reshape(-1, QK_K), scale, -low


def _q6_k(b: torch.Tensor) -> Unpacked:
    ql = _nibbles(b[:, :128].reshape(-1, 2, 64), 2).reshape(-1, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)[None, None, :, None]
    qh = ((b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 8, 32)
    codes = (ql | (qh << 4)).to(torch.int8) - 32
    sc = b[:, 192:208].contiguous().view(torch.int8).float()
    return codes.reshape(-1, QK_K), _f16(b[:, 208:210])[:, None] * sc, None


# GGML type name -> (values per block, bytes per block, group size, 4-bit codes, unpacker).
BLOCK_TYPES: dict[str, tuple[int, int, int, bool, Callable[[torch.Tensor], Unpacked]]] = {
    "Q4_0": (32, 18, 32, True, _q4_0),
    "Q4_1": (32, 20, 32, True, _q4_1),
    "Q8_0": (32, 34, 32, False, _q8_0),
    "Q4_K": (QK_K, 144, 32, True, _q4_k),
    "Q5_K": (QK_K, 176, 32, False, _q5_k),
    "Q6_K": (QK_K, 210, 16, False, _q6_k),
}


def unpack_blocks(raw: torch.Tensor, type_name: str, cols: int) -> GroupedInts:
    """A ``[rows, cols]`` weight from its GGUF blocks (``raw``: uint8 ``[rows, row bytes]``)."""
    if type_name not in BLOCK_TYPES:
        raise ValueError(f"GGUF tensor type {type_name} is not kept quantized; supported: "
                         f"{', '.join(BLOCK_TYPES)} (quantization='none' dequantizes any type)")
    per_block, nbytes, group, four_bit, unpack = BLOCK_TYPES[type_name]
    rows = raw.shape[0]
    if cols % per_block or raw.shape[1] != cols // per_block * nbytes:
        raise ValueError(f"GGUF {type_name} rows of {cols} values must be whole blocks of "
                         f"{per_block} ({nbytes} bytes each)")
    codes, scales, offsets = unpack(raw.reshape(-1, nbytes))
    return GroupedInts(codes.to(torch.int8).reshape(rows, cols), scales.reshape(rows, -1),
                       None if offsets is None else offsets.reshape(rows, -1), group, four_bit)
