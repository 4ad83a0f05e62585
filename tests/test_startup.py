"""Start-up: a GGUF file's converted config and tokenizer, cached, equal a fresh conversion."""
from __future__ import annotations

import os

from nanoserve.config import ModelConfig
from nanoserve.models.asset_cache import _entry, cached_model_assets

TEXTS = ["Hello world", "  déjà vu <|im_start|>x\n\n", "def f(x):\n\treturn x**2  # 🙂"]


def test_cached_gguf_assets_equal_a_fresh_conversion(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE_DIR", str(tmp_path))
    fresh = cached_model_assets(smollm2_path)  # converted from the GGUF, then saved
    assert (_entry(smollm2_path) / "tokenizer.json").is_file()
    cached = cached_model_assets(smollm2_path)
    assert ModelConfig.from_hf(cached[0], cached[2]) == ModelConfig.from_hf(fresh[0], fresh[2])
    assert cached[2] == fresh[2] and fresh[2]
    a, b = fresh[1], cached[1]
    assert len(a) == len(b) and a.all_special_ids == b.all_special_ids
    for text in TEXTS:
        assert a.encode(text) == b.encode(text)
        assert a.decode(a.encode(text)) == b.decode(b.encode(text))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[1]}]
    assert (a.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == b.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


def test_cache_entry_changes_with_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE_DIR", str(tmp_path / "cache"))
    file = tmp_path / "m.gguf"
    file.write_bytes(b"GGUF" + b"\0" * 60)
    before = _entry(file)
    assert before.is_relative_to(tmp_path / "cache")
    stat = file.stat()
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert _entry(file) != before  # a replaced file is converted again
