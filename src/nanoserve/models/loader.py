"""Reads a model from disk: a Hugging Face folder (safetensors) or a GGUF file."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator, Sequence

import torch

from nanoserve.layers.parallel_state import Narrow
from nanoserve.layers.quantization.methods import RawBlocks, RawNarrow
from nanoserve.layers.quantization.mxfp4 import mxfp4_half
from nanoserve.layers.quantization.spec import QuantSpec, resolve_quant_spec
from nanoserve.config import arch_from_model_type, as_id_list
from nanoserve.models import gguf


def load_model_assets(path: Path, require_weights: bool = True) -> tuple[Any, Any, list[int]]:
    """(transformers config, tokenizer, extra EOS ids from generation_config) for a model path."""
    from transformers import AutoTokenizer

    config = load_hf_config(path)
    if gguf.is_gguf(path):
        return config, gguf.load_gguf_tokenizer(path), gguf.load_gguf_eos_token_ids(path)
    if require_weights and not list(path.glob("*.safetensors")):
        raise FileNotFoundError(f"{path} holds no *.safetensors weights "
                                "(pickle checkpoints are not loaded, by design)")
    generation = path / "generation_config.json"
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
    return config, AutoTokenizer.from_pretrained(path), as_id_list(eos)


def load_hf_config(path: Path) -> Any:
    """The transformers config of a model folder or GGUF file, its architecture checked."""
    from transformers import AutoConfig

    from nanoserve.models.registry import check_architecture

    if gguf.is_gguf(path):
        config = gguf.load_gguf_config(path)
        if not getattr(config, "architectures", None):
            config.architectures = [arch_from_model_type(config)]
    elif not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model folder "
                                "(nanoserve loads HF folders with safetensors, or .gguf files)")
    else:
        try:
            config = AutoConfig.from_pretrained(path)
        except (ValueError, OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {path / 'config.json'}: {exc}") from exc
    check_architecture(config)
    return config


class CheckpointTensor:
    """One checkpoint tensor, read whole or only a rank's slice; valid until the iterator that
    yielded it moves on. Floats come in ``dtype`` (None: as stored), integers as stored; a
    ``RawNarrow`` reads a GGUF tensor's blocks."""

    def __init__(self, name: str, shape: Sequence[int], dtype: torch.dtype | None,
                 read: Callable[[tuple[slice, ...]], torch.Tensor],
                 raw: Callable[[], torch.Tensor] | None = None, type_name: str = ""):
        self.name = name
        self.shape = tuple(shape)
        self.dtype = dtype
        self._read = read  # index () means the whole tensor
        self._raw = raw
        self._type_name = type_name

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        if self.dtype is None or not t.is_floating_point() or t.dtype.itemsize < 2:
            return t  # integers and fp8 codes stay as stored
        return t.to(self.dtype)

    def read(self, narrow: Narrow | None = None) -> torch.Tensor | RawBlocks:
        if isinstance(narrow, RawNarrow):
            return self._read_raw(narrow)
        if narrow is None or (narrow.start == 0 and narrow.dim < len(self.shape)
                              and narrow.length == self.shape[narrow.dim]):
            return self._cast(self._read(()))
        self._check(narrow)
        dim, start, length = narrow
        return self._cast(self._read((slice(None),) * dim + (slice(start, start + length),)))

    def _check(self, narrow: Narrow) -> None:
        dim, start, length = narrow
        if dim >= len(self.shape) or start < 0 or start + length > self.shape[dim]:
            # Reading past the end would silently return fewer rows: name the culprit instead.
            raise ValueError(f"checkpoint tensor {self.name!r} of shape {list(self.shape)} has no "
                             f"[{start}:{start + length}] along dim {dim}")

    def _read_raw(self, narrow: Narrow) -> RawBlocks:
        if self._raw is None:
            raise ValueError(f"checkpoint tensor {self.name!r} has no GGUF blocks")
        self._check(narrow)
        dim, start, length = narrow
        data, cols = self._raw(), self.shape[1]
        if dim == 0:
            return RawBlocks(data[start:start + length], self._type_name, cols)
        per_byte = data.shape[1] / cols  # bytes a value (a fraction for quantized blocks)
        begin, end = start * per_byte, (start + length) * per_byte
        if begin != int(begin) or end != int(end):
            raise ValueError(f"checkpoint tensor {self.name!r} ({self._type_name}) cannot be "
                             f"split at input feature {start}: not a block boundary")
        return RawBlocks(data[:, int(begin):int(end)], self._type_name, length)

    def rows(self, name: str, start: int, length: int) -> CheckpointTensor:
        """Rows ``start : start + length`` as a tensor of their own, read on demand (one part
        of a fused checkpoint tensor, e.g. Phi-3's qkv_proj)."""
        def read(index: tuple[slice, ...]) -> torch.Tensor:
            first = index[0] if index else slice(None)
            lo, hi = first.start or 0, length if first.stop is None else first.stop
            return self._read((slice(start + lo, start + hi), *index[1:]))

        raw = None if self._raw is None else (
            lambda whole=self._raw: whole()[start:start + length])  # GGUF blocks are per row
        return CheckpointTensor(name, (length, *self.shape[1:]), self.dtype, read, raw,
                                self._type_name)


def iter_weights(path: Path, dtype: torch.dtype) -> Iterator[tuple[str, CheckpointTensor]]:
    """Every checkpoint tensor under its Hugging Face name, one at a time, read on demand."""
    if gguf.is_gguf(path):
        for name, tensor in gguf.iter_gguf_tensors(path):
            yield name, CheckpointTensor(
                name, tensor.shape, dtype, lambda index, t=tensor: t.dequantize(dtype)[index],
                tensor.raw, tensor.type_name)
        return
    from safetensors import SafetensorError, safe_open

    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    part = f.get_slice(name)
                    # Scales stay as stored: the layer that reads them picks their type.
                    cast = None if _is_quantization_tensor(name) else dtype
                    yield name, CheckpointTensor(name, part.get_shape(), cast, part.__getitem__)
        except SafetensorError as exc:
            raise ValueError(f"cannot read weights from {file}: {exc}") from exc


def _is_quantization_tensor(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ("qweight", "qzeros", "scales", "g_idx", "weight_scale",
                                       "weight_scale_inv", "input_scale") \
        or mxfp4_half(name) is not None


def quant_spec_of(path: Path, quantization: str) -> QuantSpec | None:
    """How the model at ``path`` holds its linear weights under ``EngineConfig.quantization``."""
    config = path / "config.json"
    quantization_config = None
    if not gguf.is_gguf(path) and config.is_file():
        quantization_config = json.loads(config.read_text()).get("quantization_config")
    return resolve_quant_spec(quantization_config, gguf.is_gguf(path), quantization)


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, std: float = 0.02) -> None:
    """Random weights of the right shapes (``load_format="dummy"``), for benchmarks; quantized
    linears make random codes of their format."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    quantized = [(n, m) for n, m in model.named_modules()
                 if getattr(getattr(m, "method", None), "quantized", False)]
    for _, module in quantized:
        module.init_dummy(gen)
    skip = tuple(f"{n}." for n, _ in quantized)
    for name, param in model.named_parameters():
        if name.startswith(skip):
            continue
        if "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, std, generator=gen)
