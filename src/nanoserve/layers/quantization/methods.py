"""Linear methods (vLLM's LinearMethod): how a linear layer holds its weight. A method registers
the parameters the checkpoint fills (``create_weights``), copies each loaded part in (``load``),
turns them into what it multiplies once every part is in (``finish``) and multiplies (``apply``).
The model builder picks them for every linear built inside :func:`quantized_linears`."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from nanoserve.layers.parallel_state import Narrow
from nanoserve.layers.quantization.packed import (GroupedInts, GroupedMatrix, Int4Matrix,
                                                  concat_rows, pack_for_matmul)
from nanoserve.layers.quantization.spec import QuantSpec

_spec: QuantSpec | None = None


@contextmanager
def quantized_linears(spec: QuantSpec | None) -> Iterator[None]:
    """Linear layers built inside this block hold their weights as ``spec`` says."""
    global _spec
    previous, _spec = _spec, spec
    try:
        yield
    finally:
        _spec = previous


def gguf_blocks_kept() -> bool:
    """Whether layers built now keep a GGUF file's blocks quantized (``quantized_linears``)."""
    return _spec is not None and _spec.method == "gguf" and not _spec.dequantize


class RawNarrow(Narrow):
    """A rank's part of a checkpoint tensor, read as the file stores it (GGUF blocks)."""

    __slots__ = ()


@dataclass
class RawBlocks:
    """A GGUF tensor's part as stored: ``data`` ``[rows, row bytes]`` of ``type_name`` blocks
    holding ``cols`` values a row (or float values for unquantized types)."""

    data: torch.Tensor
    type_name: str
    cols: int

    def to(self, dtype: torch.dtype) -> RawBlocks:  # the loader casts what it reads: not blocks
        return self


def _param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
           output_dim: int | None, input_dim: int | None, out_pack: int = 1) -> nn.Parameter:
    """Register a checkpoint-filled parameter; the dims say how ranks and shards slice it."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.output_dim, param.input_dim, param.out_pack = output_dim, input_dim, out_pack
    layer.register_parameter(name, param)
    return param


class LinearMethod:
    """Dense weights (the default): one ``weight`` ``[out, in]`` in the model's dtype."""

    reads_raw = False  # checkpoint parts come as RawBlocks
    quantized = False

    def __init__(self, spec: QuantSpec | None = None):
        self.spec = spec
        # The model is built under the engine's default dtype and device; loading is not.
        self.dtype = torch.get_default_dtype()
        self.device = torch.empty(0).device

    def create_weights(self, layer: nn.Module, in_features: int, in_per_rank: int,
                       out_per_rank: int, row_parallel: bool) -> None:
        _param(layer, "weight", (out_per_rank, in_per_rank), torch.get_default_dtype(), 0, 1)

    def load(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, dim: int | None,
             offset: int, size: int) -> None:
        (param.data if dim is None else param.data.narrow(dim, offset, size)).copy_(loaded)

    def finish(self, layer: nn.Module) -> None:
        """Called once every part of every parameter is loaded."""

    def init_dummy(self, layer: nn.Module, gen: torch.Generator) -> None:
        layer.weight.normal_(0.0, 0.02, generator=gen)

    def become_dense(self, layer: nn.Module, weight: torch.Tensor, names: tuple[str, ...]
                     ) -> None:
        """Replace the checkpoint's parameters by a dense ``weight`` of the model's dtype."""
        for name in names:
            delattr(layer, name)
        layer.weight = nn.Parameter(weight.to(self.device, self.dtype), requires_grad=False)
        layer.packed = None

    def become_packed(self, layer: nn.Module, w: GroupedInts, names: tuple[str, ...]) -> None:
        """Replace the checkpoint's parameters by ``w`` packed for the matmul."""
        for name in names:
            delattr(layer, name)
        layer.packed = pack_for_matmul(w, self.dtype)


class GGUFMethod(LinearMethod):
    """GGUF blocks, kept: each q/k/v or gate/up part unpacked at load, stacked, packed for the
    device (4-bit types into the int4 kernels' layout); float parts or types without a kernel
    here (wider codes on CUDA, types not in ``BLOCK_TYPES``) make the layer dense."""

    reads_raw = quantized = True

    def create_weights(self, layer, in_features, in_per_rank, out_per_rank, row_parallel):
        # A placeholder named as the checkpoint's tensor: the parts arrive as blocks.
        param = _param(layer, "weight", (0,), torch.uint8, 0, 1)
        param.logical_shape = (out_per_rank, in_per_rank)
        layer.gguf_parts = {}

    def load(self, layer, param, loaded, dim, offset, size):
        if not isinstance(loaded, RawBlocks):
            raise TypeError("a GGUF layer loads GGUF blocks")
        data = loaded.data.to(self.device)
        layer.gguf_parts[offset if dim == 0 else 0] = RawBlocks(data, loaded.type_name,
                                                                loaded.cols)

    def finish(self, layer):
        from nanoserve.layers.quantization.gguf_blocks import BLOCK_TYPES, unpack_blocks

        parts = [layer.gguf_parts[k] for k in sorted(layer.gguf_parts)]
        del layer.gguf_parts
        if self.spec.dequantize or any(p.type_name not in BLOCK_TYPES for p in parts):
            dense = torch.cat([_dequantize_raw(p) for p in parts])
            return self.become_dense(layer, dense, ("weight",))
        w = concat_rows([unpack_blocks(p.data, p.type_name, p.cols) for p in parts])
        if not w.four_bit and self.device.type == "cuda":  # no GPU kernel for wider codes
            return self.become_dense(layer, w.dequantize(), ("weight",))
        self.become_packed(layer, w, ("weight",))

    def finished_state(self, layer: nn.Module) -> tuple[dict[str, torch.Tensor], dict] | None:
        """A finished layer's packed matrix as tensors and metadata (None: it became dense,
        its ``weight`` a plain parameter), for the weight cache."""
        return None if layer.packed is None else layer.packed.state()

    def restore(self, layer: nn.Module, packed: Int4Matrix | GroupedMatrix | None,
                dense: torch.Tensor | None) -> None:
        """Finish the layer with a matrix rebuilt from :meth:`finished_state` (or, for a
        layer that became dense, its weight) instead of from its blocks."""
        del layer.gguf_parts
        if packed is None:
            return self.become_dense(layer, dense, ("weight",))
        delattr(layer, "weight")
        layer.packed = packed

    def init_dummy(self, layer, gen):
        raise ValueError("load_format='dummy' has no GGUF blocks to make: give the dummy "
                         "model an awq or gptq quantization_config")


def _dequantize_raw(part: RawBlocks) -> torch.Tensor:
    from nanoserve.layers.quantization.gguf_blocks import BLOCK_TYPES, unpack_blocks
    if part.type_name in BLOCK_TYPES:
        return unpack_blocks(part.data, part.type_name, part.cols).dequantize()
    if part.data.is_floating_point():
        return part.data.float()
    import gguf
    array = gguf.quants.dequantize(part.data.cpu().numpy(), gguf.GGMLQuantizationType[
        part.type_name])
    return torch.from_numpy(array).reshape(part.data.shape[0], part.cols).to(part.data.device)


def make_linear_method() -> LinearMethod:
    """The method for a linear built now (see :func:`quantized_linears`)."""
    if _spec is None or _spec.method == "mxfp4":  # MXFP4 holds experts only, no linears
        return LinearMethod()
    if _spec.method == "gguf":
        return GGUFMethod(_spec)
    if _spec.method in ("fp8", "compressed-tensors"):
        from nanoserve.layers.quantization.fp8 import Fp8Method
        return Fp8Method(_spec)
    from nanoserve.layers.quantization.gptq_awq import Int4CheckpointMethod
    return Int4CheckpointMethod(_spec)
