"""A GGUF file's header, read fast: its scalar metadata and its tensor index, over a memory map.

gguf's ``GGUFReader`` makes a numpy view of every element of every metadata array, so opening
a file with a 50k-token vocabulary and as many merges takes seconds; loading the weights needs
only the tensor index that follows those arrays. This walks the header with ``struct``,
stepping over arrays of strings by their lengths, and gives each tensor the same numpy view of
the memory map as ``GGUFReader`` (its types and sizes from the ``gguf`` package).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import (GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType,
                            GGUFValueType)
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS
from gguf.quants import quant_shape_to_byte_shape

_SCALARS = {  # little-endian struct formats of the fixed-size value types
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_STRUCTS = {t: struct.Struct(f) for t, f in _SCALARS.items()}
_U32, _U64 = _STRUCTS[GGUFValueType.UINT32], _STRUCTS[GGUFValueType.UINT64]
# Tensor types whose data GGUFReader views as numbers; every other type as bytes of blocks.
_ELEMENT_TYPES = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class IndexedTensor:
    """One tensor of the index: ``shape`` in GGUF's order (fastest dimension first), ``data``
    a read-only view of the mapped file (``[rows, row bytes]`` of uint8 for block types)
    starting at byte ``data_offset``."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray
    data_offset: int


class GGUFIndex:
    """A GGUF file's scalar metadata (``fields``; arrays of numbers as numpy arrays, arrays of
    strings stepped over) and its ``tensors``, in file order. Raises ValueError, struct.error
    or IndexError on a file that is not a well-formed little-endian GGUF v2/v3."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.data = np.memmap(self.path, mode="r")
        self._buf = memoryview(self.data)
        self.fields: dict[str, Any] = {}
        if bytes(self._buf[:4]) != b"GGUF":
            raise ValueError("bad magic")
        version = _U32.unpack_from(self._buf, 4)[0]
        if version & 0xFFFF == 0:  # another byte order's small version number
            raise ValueError("big-endian GGUF files are not supported")
        if version not in READER_SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported")
        tensor_count, kv_count = struct.unpack_from("<QQ", self._buf, 8)
        offs = 24
        for _ in range(kv_count):
            key, offs = self._string(offs)
            kind = GGUFValueType(_U32.unpack_from(self._buf, offs)[0])
            value, offs = self._value(kind, offs + 4)
            if key in self.fields:
                raise ValueError(f"duplicate metadata key {key!r}")
            self.fields[key] = value
        infos = []
        for _ in range(tensor_count):
            name, offs = self._string(offs)
            (n_dims,) = _U32.unpack_from(self._buf, offs)
            dims = struct.unpack_from(f"<{n_dims}Q", self._buf, offs + 4)
            kind, offset = struct.unpack_from("<IQ", self._buf, offs + 4 + 8 * n_dims)
            offs += 4 + 8 * n_dims + 12
            infos.append((name, dims, GGMLQuantizationType(kind), offset))
        alignment = self.fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"invalid general.alignment {alignment!r}")
        self.data_offset = -(-offs // alignment) * alignment
        self.tensors = [self._tensor(*info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("duplicate tensor names")

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def _string(self, offs: int) -> tuple[str, int]:
        (size,) = _U64.unpack_from(self._buf, offs)
        end = offs + 8 + size
        if end > len(self._buf):
            raise ValueError(f"a string at byte {offs} runs past the end of the file")
        return str(self._buf[offs + 8:end], "utf-8"), end

    def _value(self, kind: GGUFValueType, offs: int) -> tuple[Any, int]:
        if kind == GGUFValueType.STRING:
            return self._string(offs)
        if kind in _STRUCTS:
            s = _STRUCTS[kind]
            return s.unpack_from(self._buf, offs)[0], offs + s.size
        if kind != GGUFValueType.ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item = GGUFValueType(_U32.unpack_from(self._buf, offs)[0])
        (count,) = _U64.unpack_from(self._buf, offs + 4)
        offs += 12
        if item in _STRUCTS:
            size = _STRUCTS[item].size * count
            if offs + size > len(self._buf):
                raise ValueError(f"an array at byte {offs} runs past the end of the file")
            dtype = np.dtype(_SCALARS[item])
            return np.frombuffer(self._buf, dtype, count, offs), offs + size
        for _ in range(count):  # strings or nested arrays: only their lengths are read
            if item == GGUFValueType.STRING:
                offs += 8 + _U64.unpack_from(self._buf, offs)[0]
            else:
                offs = self._value(item, offs)[1]
        if offs > len(self._buf):
            raise ValueError("an array of strings runs past the end of the file")
        return None, offs

    def _tensor(self, name: str, dims: tuple[int, ...], kind: GGMLQuantizationType,
                offset: int) -> IndexedTensor:
        n_elements = int(np.prod(dims))
        shape = tuple(reversed(dims))
        start = self.data_offset + offset
        if kind in _ELEMENT_TYPES:
            dtype, count = np.dtype(_ELEMENT_TYPES[kind]), n_elements
        else:
            block_size, type_size = GGML_QUANT_SIZES[kind]
            dtype, count = np.dtype(np.uint8), n_elements * type_size // block_size
            shape = quant_shape_to_byte_shape(shape, kind)
        if start + count * dtype.itemsize > len(self.data):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        data = self.data[start:start + count * dtype.itemsize].view(dtype).reshape(shape)
        return IndexedTensor(name, kind, dims, data, start)
