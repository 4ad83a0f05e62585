"""Reads a model from disk: a Hugging Face folder (safetensors) or a GGUF file."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator, Sequence

import torch

from nanoserve.layers.parallel_state import Narrow
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
    yielded it moves on."""

    def __init__(self, name: str, shape: Sequence[int], dtype: torch.dtype,
                 read: Callable[[tuple[slice, ...]], torch.Tensor]):
        self.name = name
        self.shape = tuple(shape)
        self.dtype = dtype
        self._read = read  # index () means the whole tensor

    def read(self, narrow: Narrow | None = None) -> torch.Tensor:
        if narrow is None or (narrow.start == 0 and narrow.dim < len(self.shape)
                              and narrow.length == self.shape[narrow.dim]):
            return self._read(()).to(self.dtype)
        dim, start, length = narrow
        if dim >= len(self.shape) or start < 0 or start + length > self.shape[dim]:
            # Reading past the end would silently return fewer rows: name the culprit instead.
            raise ValueError(f"checkpoint tensor {self.name!r} of shape {list(self.shape)} has no "
                             f"[{start}:{start + length}] along dim {dim}")
        return self._read((slice(None),) * dim + (slice(start, start + length),)).to(self.dtype)

    def rows(self, name: str, start: int, length: int) -> CheckpointTensor:
        """Rows ``start : start + length`` as a tensor of their own, read on demand (one part
        of a fused checkpoint tensor, e.g. Phi-3's qkv_proj)."""
        def read(index: tuple[slice, ...]) -> torch.Tensor:
            first = index[0] if index else slice(None)
            lo, hi = first.start or 0, length if first.stop is None else first.stop
            return self._read((slice(start + lo, start + hi), *index[1:]))

        return CheckpointTensor(name, (length, *self.shape[1:]), self.dtype, read)


def iter_weights(path: Path, dtype: torch.dtype) -> Iterator[tuple[str, CheckpointTensor]]:
    """Every checkpoint tensor under its Hugging Face name, one at a time, read on demand."""
    if gguf.is_gguf(path):
        for name, tensor in gguf.iter_gguf_weights(path, dtype):
            yield name, CheckpointTensor(name, tensor.shape, dtype, tensor.__getitem__)
        return
    from safetensors import SafetensorError, safe_open

    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    part = f.get_slice(name)
                    yield name, CheckpointTensor(name, part.get_shape(), dtype, part.__getitem__)
        except SafetensorError as exc:
            raise ValueError(f"cannot read weights from {file}: {exc}") from exc


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, std: float = 0.02) -> None:
    """Random weights of the right shapes (``load_format="dummy"``), for benchmarks."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, std, generator=gen)
