"""A GGUF file's config and tokenizer, converted once and kept as a plain Hugging Face folder.

transformers' GGUF support parses the whole file (every tokenizer entry in Python) for the
config, again for the tokenizer, and ``gguf`` once more for the EOS ids: seconds each time.
The converted config.json and tokenizer.json load in a fraction of that, so the first load
saves them under ``$NANOSERVE_CACHE_DIR`` (default ``~/.cache/nanoserve``), keyed by the
file's path, size and modification time, and later loads read them instead.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from nanoserve.models import gguf
from nanoserve.models.loader import load_model_assets

logger = logging.getLogger(__name__)
CACHE_FORMAT = 2  # bump when what is saved changes (2: gguf_names.fill_config)


def cache_root() -> Path:
    return Path(os.environ.get("NANOSERVE_CACHE_DIR") or Path.home() / ".cache" / "nanoserve")


def _entry(file: Path) -> Path:
    import transformers

    stat = file.stat()
    key = json.dumps([str(file.resolve()), stat.st_size, stat.st_mtime_ns, CACHE_FORMAT,
                      transformers.__version__])
    return cache_root() / "gguf-assets" / hashlib.sha256(key.encode()).hexdigest()[:24]


def cached_model_assets(path: Path, require_weights: bool = True) -> tuple[Any, Any, list[int]]:
    """``load_model_assets(path)``, from the cache for a GGUF file once it has been read."""
    if not gguf.is_gguf(path) or not path.is_file():
        return load_model_assets(path, require_weights)
    entry = _entry(path)
    if (entry / "eos_token_ids.json").is_file():
        try:
            return _read(entry)
        except (OSError, ValueError) as exc:  # a damaged entry: convert again
            logger.warning("ignoring the cached assets in %s: %s", entry, exc)
    config, tokenizer, eos = load_model_assets(path, require_weights)
    try:
        if not _write(entry, config, tokenizer, eos):
            # transformers rebuilds some classes' pipelines on load (Gemma's, from a GPT-2
            # vocabulary): a cached copy would tokenize differently from the file.
            logger.warning("not caching %s's config and tokenizer: its tokenizer reloads "
                           "differently from save_pretrained", path.name)
    except OSError as exc:  # a read-only home: still served, just not cached
        logger.warning("cannot cache %s's config and tokenizer: %s", path.name, exc)
    return config, tokenizer, eos


def _read(entry: Path) -> tuple[Any, Any, list[int]]:
    from transformers import AutoConfig, AutoTokenizer

    from nanoserve.models.registry import check_architecture

    config = AutoConfig.from_pretrained(entry)
    check_architecture(config)
    eos = json.loads((entry / "eos_token_ids.json").read_text())
    return config, AutoTokenizer.from_pretrained(entry), [int(t) for t in eos]


def _write(entry: Path, config: Any, tokenizer: Any, eos: list[int]) -> bool:
    """Save the entry; False (nothing saved) where the tokenizer would not load back the same."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=entry.parent))
    try:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if not _round_trips(tokenizer, tmp):
            return False
        (tmp / "eos_token_ids.json").write_text(json.dumps(eos))  # written last: complete
        os.replace(tmp, entry)  # atomic; a concurrent writer's entry is as good
        return True
    except OSError:
        if not entry.exists():
            raise
        return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# Text that exercises the pre-tokenizer (spaces, newlines, accents, digits) and a special token.
_PROBE = "Hello, world!\n  Ünïcödé\tand  spaces 1234 <|im_start|>user"


def _round_trips(tokenizer: Any, saved: Path) -> bool:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(saved).encode(_PROBE) == tokenizer.encode(_PROBE)
