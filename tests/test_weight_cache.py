"""The GGUF weight cache: a cached load equals a conversion, stale or damaged entries are refused
and rebuilt, and other settings get entries of their own."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil

import gguf
import numpy as np
import pytest
import torch

from nanoserve.config import EngineConfig, ModelConfig
from nanoserve.layers.quantization.packed import GroupedMatrix, Int4Matrix
from nanoserve.layers.quantization.spec import QuantSpec
from nanoserve.models.asset_cache import cached_model_assets
from nanoserve.models.gguf_index import GGUFIndex
from nanoserve.models.weight_cache import _tensors_hash, weight_cache_entry
from nanoserve.runner import model_runner
from nanoserve.runner.model_runner import ModelRunner


@pytest.fixture(scope="module")
def model_config(smollm2_path):
    config, _, eos = cached_model_assets(smollm2_path)
    return ModelConfig.from_hf(config, eos)


@pytest.fixture()
def gguf_copy(smollm2_path, tmp_path, monkeypatch):
    """The default model's file under a path of its own, and a cache of its own."""
    monkeypatch.setenv("NANOSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("NANOSERVE_WEIGHT_CACHE", raising=False)
    return shutil.copy(smollm2_path, tmp_path / "model.gguf")


class Conversions:
    """Counts the loads that read the GGUF file's tensors (a cache miss)."""

    def __init__(self, monkeypatch):
        self.count = 0
        original = model_runner.iter_weights

        def counted(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(model_runner, "iter_weights", counted)


def _load(path, model_config) -> ModelRunner:
    config = EngineConfig(model=str(path), device="cpu", max_model_len=64, max_num_seqs=2,
                          num_kv_blocks=8)
    return ModelRunner(config, model_config, path)


def _state(runner: ModelRunner) -> dict[str, object]:
    """Every parameter and every attribute of every packed matrix, read without the cache's
    own serialisation."""
    state: dict[str, object] = {n: p.detach() for n, p in runner.model.named_parameters()}
    for name, module in runner.model.named_modules():
        packed = getattr(module, "packed", None)
        if packed is not None:
            attrs = dict(vars(packed))
            # A GroupedMatrix's GroupedInts, a SplitInt4Matrix's Int4Matrix: their attributes.
            for inner in [k for k, v in attrs.items() if hasattr(v, "__dict__")
                          and not isinstance(v, torch.Tensor | torch.dtype)]:
                attrs.update({f"{inner}.{k}": v for k, v in vars(attrs.pop(inner)).items()})
            state.update({f"{name}.packed.{k}": v for k, v in attrs.items()})
    return state


def _assert_same(a: dict[str, object], b: dict[str, object]) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == b[name].dtype and torch.equal(value, b[name]), name
        else:
            assert value == b[name], name


def _change_a_weight(path) -> str:
    """Rewrite a Q4_1 block's codes in place, size and modification time kept."""
    stat = os.stat(path)
    tensor = next(t for t in GGUFIndex(path).tensors if t.name == "blk.0.ffn_down.weight")
    offset = tensor.data_offset  # bytes 4.. of a Q4_1 block are its codes
    with open(path, "r+b") as f:
        f.seek(offset + 4)
        codes = f.read(16)
        f.seek(offset + 4)
        f.write(bytes(c ^ 0x55 for c in codes))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    return "model.layers.0.mlp.down_proj"


def test_cached_load_equals_a_conversion(gguf_copy, model_config, monkeypatch):
    conversions = Conversions(monkeypatch)
    converted = _load(gguf_copy, model_config)
    assert conversions.count == 1
    entry = weight_cache_entry(gguf_copy, QuantSpec("gguf"), torch.device("cpu"),
                               torch.float32, 1)
    assert entry.path.is_file()
    cached = _load(gguf_copy, model_config)
    assert conversions.count == 1  # read from the entry
    assert any(getattr(m, "packed", None) is not None for m in cached.model.modules())
    _assert_same(_state(converted), _state(cached))
    # Tied embeddings stay one tensor.
    assert cached.model.lm_head.weight is cached.model.model.embed_tokens.weight


def test_changed_file_is_converted_again(gguf_copy, model_config, monkeypatch):
    conversions = Conversions(monkeypatch)
    before = _state(_load(gguf_copy, model_config))
    layer = _change_a_weight(gguf_copy)  # same size, same mtime: only the bytes tell
    after = _load(gguf_copy, model_config)
    assert conversions.count == 2
    changed = _state(after)
    key = f"{layer}.packed.cpu_packed"
    assert not torch.equal(before[key], changed[key])
    monkeypatch.setenv("NANOSERVE_WEIGHT_CACHE", "0")
    _assert_same(_state(_load(gguf_copy, model_config)), changed)  # the new file's weights
    monkeypatch.delenv("NANOSERVE_WEIGHT_CACHE")
    _assert_same(_state(_load(gguf_copy, model_config)), changed)  # and its entry, rewritten
    assert conversions.count == 3


def _drop_a_tensor(path) -> None:
    """Rewrite the entry without one tensor, its hash redone: only the layout check tells."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        header = json.loads(f.metadata()["nanoserve"])
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "model.norm.weight"}
    header["tensors_xxh3_128"] = _tensors_hash(tensors)
    save_file(tensors, str(path), metadata={"nanoserve": json.dumps(header)})


@pytest.mark.parametrize("damage", ["truncate", "flip a tensor byte", "garbage",
                                    "a tensor missing"])
def test_damaged_entry_is_rebuilt(gguf_copy, model_config, monkeypatch, caplog, damage):
    conversions = Conversions(monkeypatch)
    reference = _state(_load(gguf_copy, model_config))
    entry = weight_cache_entry(gguf_copy, QuantSpec("gguf"), torch.device("cpu"),
                               torch.float32, 1)
    if damage == "a tensor missing":
        _drop_a_tensor(entry.path)
    data = bytearray(entry.path.read_bytes())
    if damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "flip a tensor byte":  # the header stays valid: only the hash tells
        data[-1000] ^= 0xFF
    elif damage == "garbage":
        data = bytearray(b"not a safetensors file")
    entry.path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="nanoserve"):
        _assert_same(_state(_load(gguf_copy, model_config)), reference)
    assert conversions.count == 2  # refused, converted, saved again
    reason = {"flip a tensor byte": "its tensors are damaged",
              "a tensor missing": "model.norm.weight"}.get(damage, "not using the cached")
    assert reason in caplog.text and str(entry.path) in caplog.text
    _assert_same(_state(_load(gguf_copy, model_config)), reference)
    assert conversions.count == 2


def test_entries_per_settings(gguf_copy, monkeypatch):
    cpu, spec = torch.device("cpu"), QuantSpec("gguf")
    base = weight_cache_entry(gguf_copy, spec, cpu, torch.float32, 1).path
    assert weight_cache_entry(gguf_copy, spec, cpu, torch.bfloat16, 1).path != base
    assert weight_cache_entry(gguf_copy, dataclasses.replace(spec, bits=8), cpu,
                              torch.float32, 1).path != base
    # No entry where the conversion is not the CPU's, or nothing stays quantized.
    assert weight_cache_entry(gguf_copy, spec, torch.device("cuda"), torch.float32, 1) is None
    assert weight_cache_entry(gguf_copy, spec, cpu, torch.float32, 2) is None
    assert weight_cache_entry(gguf_copy, dataclasses.replace(spec, dequantize=True), cpu,
                              torch.float32, 1) is None
    monkeypatch.setenv("NANOSERVE_WEIGHT_CACHE", "0")
    assert weight_cache_entry(gguf_copy, spec, cpu, torch.float32, 1) is None


def test_a_file_keeps_at_most_two_entries(gguf_copy, model_config, monkeypatch):
    def entry(dtype):
        return weight_cache_entry(gguf_copy, QuantSpec("gguf"), torch.device("cpu"), dtype, 1)

    runner = _load(gguf_copy, model_config)
    for dtype in (torch.bfloat16, torch.float16):  # entries of other settings, then pruned
        entry(dtype).save(runner.model)
    kept = sorted(entry(torch.float32).path.parent.iterdir())
    assert kept == sorted([entry(torch.bfloat16).path, entry(torch.float16).path])


def _tiny_mixed_gguf(path):
    """A one-layer llama whose linears end in each finished form: q/k/v Q4_0 (int4 kernel),
    o/down Q8_0 (grouped codes), gate/up F32 (dense)."""
    rng = np.random.default_rng(0)
    q4, q8 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0
    shapes = {"token_embd.weight": ((256, 64), None), "output.weight": ((256, 64), None),
              "output_norm.weight": ((64,), None), "blk.0.attn_norm.weight": ((64,), None),
              "blk.0.ffn_norm.weight": ((64,), None), "blk.0.attn_q.weight": ((64, 64), q4),
              "blk.0.attn_k.weight": ((32, 64), q4), "blk.0.attn_v.weight": ((32, 64), q4),
              "blk.0.attn_output.weight": ((64, 64), q8),
              "blk.0.ffn_down.weight": ((64, 128), q8),
              "blk.0.ffn_gate.weight": ((128, 64), None), "blk.0.ffn_up.weight": ((128, 64), None)}
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    for name, (shape, kind) in shapes.items():
        w = rng.standard_normal(shape, dtype=np.float32)
        if kind is None:
            writer.add_tensor(name, w)
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from transformers import LlamaConfig
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         vocab_size=256, tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]
    return ModelConfig.from_hf(config, [])


def test_every_finished_form_round_trips(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "mixed.gguf"
    config = _tiny_mixed_gguf(path)
    conversions = Conversions(monkeypatch)
    converted, cached = _load(path, config), _load(path, config)
    assert conversions.count == 1
    layers = cached.model.model.layers[0]
    assert isinstance(layers.self_attn.qkv_proj.packed, Int4Matrix)
    assert isinstance(layers.self_attn.o_proj.packed, GroupedMatrix)
    assert layers.mlp.gate_up_proj.packed is None and layers.mlp.gate_up_proj.weight.shape == (
        256, 64)
    _assert_same(_state(converted), _state(cached))
