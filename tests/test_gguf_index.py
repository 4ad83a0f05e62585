"""The fast GGUF header reader against gguf's own GGUFReader, and its errors."""
from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from nanoserve.models.gguf import iter_gguf_weights
from nanoserve.models.gguf_index import GGUFIndex


def _assert_matches_reader(path) -> GGUFIndex:
    index, reader = GGUFIndex(path), gguf.GGUFReader(path)
    assert index.data_offset == reader.data_offset
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for mine, theirs in zip(index.tensors, reader.tensors):
        assert mine.tensor_type == theirs.tensor_type
        assert list(mine.shape) == theirs.shape.tolist()
        assert mine.data_offset == theirs.data_offset
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, theirs.data)
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert list(index.fields) == keys
    for key in keys:
        field, value = reader.fields[key], index.fields[key]
        if field.types[0] == gguf.GGUFValueType.ARRAY and field.types[1] in (
                gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY):
            assert value is None  # stepped over
        elif isinstance(value, np.ndarray):
            assert value.tolist() == list(field.contents())
        else:
            assert value == field.contents(), key
    return index


def test_default_model_matches_the_reader(smollm2_path):
    index = _assert_matches_reader(smollm2_path)
    assert index.get("llama.attention.head_count") == 9
    assert index.get("tokenizer.ggml.eos_token_id") == 2


def test_every_value_type_and_an_alignment(tmp_path):
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_int32("t.i32", -(2**31))
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float32("t.f32", 1.5)
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "déjà vu")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.strs", ["a", "bc", ""])
    writer.add_array("t.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    writer.add_tensor("a", rng.standard_normal((3, 5), dtype=np.float32))
    writer.add_tensor("b", rng.standard_normal(7).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((4, 64), dtype=np.float32),
                             gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("c", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    index = _assert_matches_reader(path)
    assert index.data_offset % 64 == 0
    assert index.get("t.str") == "déjà vu" and index.get("t.u64") == 2**63 + 5
    assert index.get("t.f64") == 0.1 and index.get("t.bool") is True


def _header(version: int = 3, tensors: int = 0, kvs: int = 0, order: str = "<") -> bytes:
    return b"GGUF" + struct.pack(f"{order}IQQ", version, tensors, kvs)


@pytest.mark.parametrize("content, message", [
    (_header(version=1), "version 1"),
    (_header(order=">"), "big-endian"),
    (_header(kvs=1) + struct.pack("<Q", 1000) + b"key", "past the end"),
    (_header(tensors=1) + struct.pack("<Q", 1) + b"w" + struct.pack("<IQIQ", 1, 64, 0, 0),
     "tensor 'w' runs past the end"),
])
def test_bad_headers_raise(tmp_path, content, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        GGUFIndex(path)
    with pytest.raises(ValueError, match=str(path)):  # the loader names the file
        list(iter_gguf_weights(path))
