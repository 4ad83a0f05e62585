"""A GGUF file's weights as the CPU multiplies them, kept between processes.

Turning GGUF blocks into what the matmuls read (codes unpacked, q/k/v and gate/up stacked,
PyTorch's packed int4 layout, the embedding dequantized) takes longer than reading the result
back. The first CPU load of a file saves every loaded parameter and packed matrix in one
safetensors file under the asset cache (``$NANOSERVE_CACHE_DIR/gguf-weights``); later loads
read that instead of converting again. ``NANOSERVE_WEIGHT_CACHE=0`` turns it off.

An entry is named by the file's path and everything its layout depends on: the dtype, the
quantization, torch's version and CPU kernel ISA (the int4 layout is theirs), this format's
version and the source of the modules that convert. It records the xxh3 hash of the GGUF
file's bytes and of its own tensors: an entry whose file changed, or whose bytes are damaged,
is refused (logged), converted again and overwritten.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch import nn

from nanoserve.layers.quantization.methods import GGUFMethod
from nanoserve.layers.quantization.packed import packed_from_state
from nanoserve.layers.quantization.spec import QuantSpec
from nanoserve.models import gguf
from nanoserve.models.asset_cache import cache_root

logger = logging.getLogger(__name__)
FORMAT = 1  # bump when what an entry holds changes
# Their source is part of an entry's name: a change to how weights are converted renames it.
_CONVERTING_MODULES = ("models/gguf.py", "models/gguf_index.py", "models/loader.py",
                       "models/weight_map.py", "models/decoder.py", "layers/linear.py",
                       "layers/embedding.py", "layers/quantization/methods.py",
                       "layers/quantization/packed.py", "layers/quantization/gguf_blocks.py")
_HASH_CHUNK = 1 << 24


class StaleEntry(ValueError):
    """The entry was made from another file, with other settings, or is damaged."""


def weight_cache_entry(path: Path, spec: QuantSpec | None, device: torch.device,
                       dtype: torch.dtype, tp_size: int) -> WeightCacheEntry | None:
    """The entry for loading ``path`` so; None where no cache applies: off, not a GGUF file
    whose blocks stay quantized, not the CPU, or tensor parallel."""
    if (os.environ.get("NANOSERVE_WEIGHT_CACHE", "1") == "0" or not gguf.is_gguf(path)
            or spec is None or spec.method != "gguf" or spec.dequantize
            or device.type != "cpu" or tp_size != 1):
        return None
    file = gguf._resolve_gguf_file(path).resolve()
    settings = {"format": FORMAT, "file": str(file), "dtype": str(dtype),
                "quantization": dataclasses.asdict(spec), "torch": torch.__version__,
                "cpu_isa": torch.backends.cpu.get_cpu_capability(), "code": _code_hash()}
    return WeightCacheEntry(file, settings)


@functools.cache
def _code_hash() -> str:
    root = Path(__file__).resolve().parents[1]
    h = xxhash.xxh3_128()
    for name in _CONVERTING_MODULES:
        h.update((root / name).read_bytes())
    return h.hexdigest()


@functools.lru_cache(maxsize=4)
def _file_hash(file: Path, stat_key: tuple[int, ...]) -> str:
    h = xxhash.xxh3_128()
    with file.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _tensors_hash(tensors: dict[str, torch.Tensor]) -> str:
    h = xxhash.xxh3_128()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")
    return h.hexdigest()


class WeightCacheEntry:
    """One file's cached weights under one set of settings: ``restore`` into a built model,
    or ``save`` a loaded one."""

    def __init__(self, file: Path, settings: dict[str, Any]):
        self.file = file
        self.settings = json.loads(json.dumps(settings))  # as the entry's header gives it back
        # One file's entries share a prefix: saving one prunes all but the newest other.
        self._prefix = f"{file.stem[:64]}-{xxhash.xxh64_hexdigest(str(file).encode())}-"
        digest = xxhash.xxh3_128_hexdigest(json.dumps(settings, sort_keys=True).encode())
        self.path = cache_root() / "gguf-weights" / f"{self._prefix}{digest}.safetensors"

    def source_hash(self) -> str:
        # Any write moves ctime, even one whose mtime was set back.
        st = self.file.stat()
        return _file_hash(self.file, (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))

    def restore(self, model: nn.Module) -> bool:
        """Fill ``model`` (built, not loaded) from the entry; False where there is no usable
        entry (a refused one is logged), the model then untouched."""
        if not self.path.is_file():
            return False
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(self.path), framework="pt") as f:
                header = json.loads((f.metadata() or {}).get("nanoserve", "null"))
                if not isinstance(header, dict) or header.get("settings") != self.settings:
                    raise StaleEntry("made with other settings")
                if header.get("source_xxh3_128") != self.source_hash():
                    raise StaleEntry(f"{self.file.name} changed since it was made")
                tensors = {name: f.get_tensor(name) for name in f.keys()}
            if header.get("tensors_xxh3_128") != _tensors_hash(tensors):
                raise StaleEntry("its tensors are damaged")
            _fill(model, tensors, header["layers"])
        except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
            logger.warning("not using the cached weights %s (%s): converting %s again",
                           self.path, exc, self.file.name)
            return False
        logger.info("weights read from the cache: %s", self.path)
        return True

    def save(self, model: nn.Module) -> None:
        """Keep a loaded model's weights; a cache that cannot be written is only logged."""
        from safetensors.torch import save_file

        tensors, layers = _finished_tensors(model)
        header = {"settings": self.settings, "source_xxh3_128": self.source_hash(),
                  "tensors_xxh3_128": _tensors_hash(tensors), "layers": layers}
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            os.close(fd)
            save_file(tensors, tmp, metadata={"nanoserve": json.dumps(header)})
            os.replace(tmp, self.path)  # atomic: readers see a whole entry or none
            self._prune()
        except OSError as exc:
            logger.warning("cannot cache the weights of %s: %s", self.file.name, exc)
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)

    def _prune(self) -> None:
        """Keep this entry and the newest other one of the same file (another dtype, or one
        made by an earlier torch or nanoserve, which no load will ask for again)."""
        others = []
        for p in self.path.parent.glob(f"{self._prefix}*.safetensors"):
            with contextlib.suppress(OSError):  # another process may have pruned it
                if p != self.path:
                    others.append((p.stat().st_mtime_ns, p))
        for _, old in sorted(others)[:-1]:
            old.unlink(missing_ok=True)


HEAD = "lm_head"  # the CPU's packed LM head (layers/embedding.py): an entry of its own


def _gguf_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules()
            if isinstance(getattr(m, "method", None), GGUFMethod)}


def _finished_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every parameter of a loaded model, and each packed matrix's tensors under
    ``<layer>.packed.<name>``; per GGUF layer its matrix's metadata (None: dense)."""
    tensors: dict[str, torch.Tensor] = {}
    layers: dict[str, Any] = {}
    for name, module in _gguf_layers(model).items():
        state = module.method.finished_state(module)
        layers[name] = None if state is None else state[1]
        for key, t in (state[0] if state is not None else {}).items():
            tensors[f"{name}.packed.{key}"] = t
    head = getattr(model, HEAD, None)
    if getattr(head, "packed", None) is not None:
        state, layers[HEAD] = head.packed.state()
        tensors.update((f"{HEAD}.packed.{key}", t) for key, t in state.items())
    tensors.update((name, p.data) for name, p in model.named_parameters())
    seen: set[int] = set()  # safetensors refuses tensors that share memory
    for name, t in tensors.items():
        ptr = t.untyped_storage().data_ptr()
        tensors[name] = t.contiguous() if ptr not in seen else t.clone()
        seen.add(ptr)
    return tensors, layers


def _fill(model: nn.Module, tensors: dict[str, torch.Tensor], layers: dict[str, Any]) -> None:
    """Put the saved tensors in the model, every one checked against its place first."""
    gguf_layers = _gguf_layers(model)
    layers = dict(layers)
    head = layers.pop(HEAD, None)
    if head is not None and not getattr(getattr(model, HEAD, None), "reads_blocks", False):
        raise StaleEntry("it holds a packed LM head this model does not read")
    if set(layers) != set(gguf_layers):
        raise StaleEntry("its GGUF layers are not this model's")
    placeholders = {f"{name}.weight" for name in gguf_layers}
    params = {n: p for n, p in model.named_parameters() if n not in placeholders}
    expected = set(params)
    for name, meta in layers.items():
        layer = gguf_layers[name]
        shape = tuple(layer.weight.logical_shape)
        if meta is None:  # the layer became dense
            _check(tensors, f"{name}.weight", shape, layer.method.dtype)
            expected.add(f"{name}.weight")
            continue
        keys = {k for k in tensors if k.startswith(f"{name}.packed.")}
        codes = tensors.get(f"{name}.packed.codes")
        fits = ((meta.get("out_features"), meta.get("in_features")) == shape
                if meta.get("kind") == "int4" else codes is not None and codes.shape == shape)
        if not fits:
            raise StaleEntry(f"{name}'s packed matrix does not fit the layer")
        expected |= keys
    for name, p in params.items():
        _check(tensors, name, tuple(p.shape), p.dtype)
    if head is not None:
        expected |= {k for k in tensors if k.startswith(f"{HEAD}.packed.")}
    if set(tensors) != expected:
        raise StaleEntry(f"tensors {sorted(set(tensors) ^ expected)[:4]} do not match the model")
    packed = {}  # made before the model changes: a refused entry leaves it as built
    if head is not None:
        prefix = f"{HEAD}.packed."
        head = packed_from_state(
            {k[len(prefix):]: t for k, t in tensors.items() if k.startswith(prefix)}, head)
    for name, meta in layers.items():
        if meta is not None:
            prefix = f"{name}.packed."
            packed[name] = packed_from_state(
                {k[len(prefix):]: t for k, t in tensors.items() if k.startswith(prefix)}, meta)
    for name, module in gguf_layers.items():
        module.restore_finished(packed.get(name), tensors.get(f"{name}.weight"))
    for name, p in params.items():
        p.data = tensors[name]
    if head is not None:
        getattr(model, HEAD).packed = head


def _check(tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...],
           dtype: torch.dtype) -> None:
    t = tensors.get(name)
    if t is None or tuple(t.shape) != shape or t.dtype != dtype:
        found = "missing" if t is None else f"{list(t.shape)} {t.dtype}"
        raise StaleEntry(f"{name} should be {list(shape)} {dtype}, found {found}")
