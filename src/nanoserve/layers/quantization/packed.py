"""Quantized weights as the matmuls read them. Every format unpacks to :class:`GroupedInts`
(integer codes with a scale and an offset per group of input features); that becomes an
:class:`Int4Matrix` (4-bit codes: PyTorch's packed-int4 kernel on the CPU, a Triton kernel on
CUDA), a :class:`GroupedMatrix` (wider codes, dequantized in the matmul a chunk of rows at a
time), a :class:`SplitInt4Matrix` (wider codes as two 4-bit matrices: the CPU LM head) or, when
asked, a dense tensor."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from nanoserve.layers.quantization.spec import INT4_GROUP_SIZES

CHUNK_ELEMENTS = 1 << 20  # weights dequantized at once by GroupedMatrix


@dataclass
class GroupedInts:
    """``W[n, k] = codes[n, k] * scales[n, k // g] + offsets[n, k // g]`` (no offsets: 0), in
    float32; with ``perm``, the codes' column ``j`` is the input feature ``perm[j]`` (GPTQ's
    act order, sorted so that each group's features are adjacent)."""

    codes: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N, K / g]
    offsets: torch.Tensor | None  # float32 [N, K / g]
    group_size: int
    four_bit: bool  # every code in [0, 16)
    perm: torch.Tensor | None = None  # int64 [K]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[N, K]`` in the checkpoint's input order."""
        n, k = self.codes.shape
        g = self.group_size
        w = self.codes.view(n, k // g, g).float() * self.scales[:, :, None]
        if self.offsets is not None:
            w = w + self.offsets[:, :, None]
        w = w.reshape(n, k)
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w

    def regrouped(self, group_size: int) -> GroupedInts:
        """The same weight with groups of ``group_size`` (a divisor of this one's): exact."""
        r = self.group_size // group_size
        return GroupedInts(self.codes, self.scales.repeat_interleave(r, 1),
                           None if self.offsets is None else self.offsets.repeat_interleave(r, 1),
                           group_size, self.four_bit, self.perm)


def concat_rows(parts: list[GroupedInts]) -> GroupedInts:
    """Stack weights of the same input features (q, k, v; gate, up) along the output rows."""
    if len(parts) == 1:
        return parts[0]
    group = min(p.group_size for p in parts)
    parts = [p.regrouped(group) if p.group_size != group else p for p in parts]
    if any(p.perm is not None for p in parts):
        raise ValueError("act-order weights are stacked from one checkpoint tensor each")
    offsets = None
    if any(p.offsets is not None for p in parts):
        offsets = torch.cat([p.offsets if p.offsets is not None else torch.zeros_like(p.scales)
                             for p in parts])
    return GroupedInts(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                       offsets, group, all(p.four_bit for p in parts))


class Int4Matrix:
    """4-bit codes with per-group scales and zeros, ``W = (q - 8) * scale + zero`` (the form of
    PyTorch's int4 kernels, to which an offset maps exactly: ``zero = offset + 8 * scale``)."""

    def __init__(self, w: GroupedInts, dtype: torch.dtype):
        self.out_features, self.in_features = w.codes.shape
        self.group_size = w.group_size
        offsets = w.offsets if w.offsets is not None else torch.zeros_like(w.scales)
        codes = w.codes.to(torch.uint8)
        cpu_kernel = codes.device.type == "cpu" and self.out_features % 16 == 0
        # PyTorch's CPU int4 kernel is fast in bfloat16 only (float32 runs ~25x slower than
        # a dense matmul): there it computes in bfloat16, scales and activations rounded.
        self.compute_dtype = torch.bfloat16 if cpu_kernel and dtype == torch.float32 else dtype
        # [K / g, N, 2]: the kernels' scales-and-zeros layout, in the compute dtype.
        self.scales_zeros = torch.stack([w.scales, offsets + 8 * w.scales], -1) \
            .transpose(0, 1).contiguous().to(self.compute_dtype)
        self.perm = w.perm
        self.cpu_packed = None
        if cpu_kernel:
            self.cpu_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                codes.to(torch.int32), 2)
            self.packed = None
        else:  # two codes a byte, low nibble first: what the Triton kernel reads
            self.packed = codes[:, 0::2] | (codes[:, 1::2] << 4)

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Its tensors and the rest of what defines it, for :func:`packed_from_state`."""
        tensors = {"scales_zeros": self.scales_zeros}
        for name in ("cpu_packed", "packed", "perm"):
            if getattr(self, name) is not None:
                tensors[name] = getattr(self, name)
        meta = {"kind": "int4", "out_features": self.out_features,
                "in_features": self.in_features, "group_size": self.group_size,
                "compute_dtype": str(self.compute_dtype).removeprefix("torch.")}
        return tensors, meta

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Int4Matrix:
        self = cls.__new__(cls)
        self.out_features, self.in_features = int(meta["out_features"]), int(meta["in_features"])
        self.group_size = int(meta["group_size"])
        self.compute_dtype = getattr(torch, meta["compute_dtype"])
        self.scales_zeros = tensors["scales_zeros"]
        self.cpu_packed, self.packed = tensors.get("cpu_packed"), tensors.get("packed")
        self.perm = tensors.get("perm")
        if (self.cpu_packed is None) == (self.packed is None):
            raise ValueError("an int4 matrix holds exactly one of cpu_packed and packed")
        return self

    def codes(self) -> torch.Tensor:
        """The ``[N, K]`` codes (0..15) in the packed order."""
        if self.packed is None:
            raise RuntimeError("the CPU int4 layout is opaque")
        return torch.stack([self.packed & 15, self.packed >> 4], -1).reshape(
            self.out_features, self.in_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if self.cpu_packed is not None:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(self.compute_dtype), self.cpu_packed, self.group_size,
                self.scales_zeros).to(x.dtype)
        if x.is_cuda:
            from nanoserve.kernels.int4_gemm import int4_linear
            return int4_linear(x, self.packed, self.scales_zeros, self.group_size)
        return int4_matmul_reference(x, self.codes(), self.scales_zeros, self.group_size)


class SplitInt4Matrix:
    """Codes of up to 8 bits (signed or not) as two 4-bit matrices, ``code = 16 * hi + lo``
    with ``lo`` in 0..15: ``W = 16 * scale * hi + (scale * lo + offset)``, the two parts
    stacked in one :class:`Int4Matrix` whose halves of the product are summed, so that the
    int4 kernel reads a byte per weight in all (on the CPU, the LM head of a GGUF file whose
    embedding is Q8_0). The codes stay exact; the scales and the arithmetic are Int4Matrix's."""

    def __init__(self, w: GroupedInts, dtype: torch.dtype):
        if w.perm is not None:
            raise ValueError("act-order weights are 4-bit: no need to split their codes")
        codes = w.codes.to(torch.int16)
        high = torch.div(codes, 16, rounding_mode="floor")
        if int(high.min()) < -8 or int(high.max()) > 7:
            raise ValueError("SplitInt4Matrix takes codes of at most 8 bits")
        offsets = w.offsets if w.offsets is not None else torch.zeros_like(w.scales)
        # 16 * scale * (q - 8) with q = hi + 8: the offset -128 * scale makes the zero 0.
        parts = [GroupedInts((high + 8).to(torch.int8), 16 * w.scales, -128 * w.scales,
                             w.group_size, True),
                 GroupedInts((codes - 16 * high).to(torch.int8), w.scales, offsets,
                             w.group_size, True)]
        self.both = Int4Matrix(concat_rows(parts), dtype)
        self.out_features, self.in_features = w.codes.shape

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Its tensors and the rest of what defines it, for :func:`packed_from_state`."""
        tensors, both = self.both.state()
        return tensors, {"kind": "split_int4", "out_features": self.out_features,
                         "in_features": self.in_features, "both": both}

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
                   ) -> SplitInt4Matrix:
        self = cls.__new__(cls)
        self.out_features, self.in_features = int(meta["out_features"]), int(meta["in_features"])
        self.both = Int4Matrix.from_state(tensors, meta["both"])
        return self

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        high, low = self.both.matmul(x).split(self.out_features, dim=-1)
        return high + low


def pack_logits_matrix(w: GroupedInts, dtype: torch.dtype) -> Int4Matrix | SplitInt4Matrix | None:
    """An LM head's weight as the CPU int4 kernel reads it: 4-bit codes as they are, codes of
    up to 8 bits split in two; None where the kernel cannot take its groups."""
    if w.group_size not in INT4_GROUP_SIZES or w.codes.shape[1] % w.group_size:
        return None
    if w.four_bit:
        return Int4Matrix(w, dtype)
    return SplitInt4Matrix(w, dtype)


def int4_matmul_reference(x: torch.Tensor, codes: torch.Tensor, scales_zeros: torch.Tensor,
                          group_size: int) -> torch.Tensor:
    """``x @ W^T`` for :class:`Int4Matrix`'s form in plain PyTorch, a chunk of rows at a time."""
    outs = []
    n, k = codes.shape
    step = max(1, CHUNK_ELEMENTS // k)
    sz = scales_zeros.transpose(0, 1).float()  # [N, K / g, 2]
    for start in range(0, n, step):
        c = codes[start:start + step].view(-1, k // group_size, group_size).float() - 8
        part = sz[start:start + step]
        w = (c * part[..., :1] + part[..., 1:]).reshape(-1, k)
        outs.append(F.linear(x, w.to(x.dtype)))
    return torch.cat(outs, dim=-1)


class GroupedMatrix:
    """Codes wider than 4 bits (Q8_0, Q5_K, Q6_K), dequantized inside the matmul a chunk of
    output rows at a time, so that the weight stays one byte per value in memory."""

    def __init__(self, w: GroupedInts):
        self.w = w
        self.out_features, self.in_features = w.codes.shape

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Its tensors and the rest of what defines it, for :func:`packed_from_state`."""
        w = self.w
        tensors = {name: getattr(w, name) for name in ("codes", "scales", "offsets", "perm")
                   if getattr(w, name) is not None}
        return tensors, {"kind": "grouped", "group_size": w.group_size, "four_bit": w.four_bit}

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
                   ) -> GroupedMatrix:
        return cls(GroupedInts(tensors["codes"], tensors["scales"], tensors.get("offsets"),
                               int(meta["group_size"]), bool(meta["four_bit"]),
                               tensors.get("perm")))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        w, k, g = self.w, self.in_features, self.w.group_size
        if w.perm is not None:
            x = x.index_select(-1, w.perm)
        step = max(1, CHUNK_ELEMENTS // k)
        outs = []
        for start in range(0, self.out_features, step):
            end = start + step
            chunk = w.codes[start:end].view(-1, k // g, g).float() * w.scales[start:end, :, None]
            if w.offsets is not None:
                chunk = chunk + w.offsets[start:end, :, None]
            outs.append(F.linear(x, chunk.reshape(-1, k).to(x.dtype)))
        return torch.cat(outs, dim=-1)


def pack_for_matmul(w: GroupedInts, dtype: torch.dtype) -> Int4Matrix | GroupedMatrix:
    """The fastest form this device multiplies ``w`` in without changing its values."""
    if w.four_bit and w.group_size in INT4_GROUP_SIZES and w.codes.shape[1] % w.group_size == 0:
        return Int4Matrix(w, dtype)
    return GroupedMatrix(w)


def packed_from_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]
                      ) -> Int4Matrix | SplitInt4Matrix | GroupedMatrix:
    """The matrix whose ``state()`` gave ``tensors`` and ``meta``."""
    kinds = {"int4": Int4Matrix, "split_int4": SplitInt4Matrix, "grouped": GroupedMatrix}
    if meta.get("kind") not in kinds:
        raise ValueError(f"unknown packed matrix kind {meta.get('kind')!r}")
    return kinds[meta["kind"]].from_state(tensors, meta)
