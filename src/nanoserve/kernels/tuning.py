"""Kernel launch configurations as data: ``configs/<op>/<device>.json`` beside this file holds
``{shape key: {bucket: entry}}``, written by ``nanoserve tune MODEL``, read by an op's
``select`` (:func:`load_table`, :func:`tuned`), which has its own heuristic for shapes it
lacks. The bucket is of what else the launch depends on (rows, batch and context), ``"all"``
where nothing else."""
from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import torch

CONFIG_DIR = Path(__file__).with_name("configs")
Config = TypeVar("Config", bound=tuple)  # a NamedTuple of launch options
Select = TypeVar("Select", bound=Callable)
# Buckets of sequences a step: a decode graph's batch sizes.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@functools.cache  # an op's select asks on every eager call: the driver is asked once
def device_key(device: torch.device) -> str:
    """The file name a device's tunings go under, e.g. ``NVIDIA_H200`` (``CPU`` for Triton's
    interpreter, whose tunings no launch reads)."""
    if device.type != "cuda":
        return "CPU"
    return re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name(device)).strip("_")


_select_caches: list = []


def memoised(select: Select) -> Select:
    """``select`` answering a repeated launch from memory: an eager step asks for every layer's
    launches, and the answer depends only on the arguments (host ints, dtypes, devices) and on
    the tables, which change only through :func:`save_entries` (it clears these caches)."""
    cached = functools.lru_cache(maxsize=1 << 14)(select)
    _select_caches.append(cached)
    return cached


def clear_caches() -> None:
    """Forget the tables read and every memoised select's answers."""
    _load.cache_clear()
    for cached in _select_caches:
        cached.cache_clear()


def table_path(op: str, key: str) -> Path:
    return CONFIG_DIR / op / f"{key}.json"


@functools.cache
def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def load_table(op: str, device: torch.device) -> dict:
    """``op``'s tunings for ``device`` (empty off CUDA or where none were written)."""
    if device.type != "cuda":
        return {}
    return _load(table_path(op, device_key(device)))


def save_entries(op: str, key: str, entries: dict) -> Path:
    """Merge ``entries`` (``{shape key: {row bucket: entry}}``) into ``op``'s file for device
    ``key``, keeping what other models' tunings wrote there, and return its path."""
    path = table_path(op, key)
    table = json.loads(path.read_text()) if path.exists() else {}
    for shape, buckets in entries.items():
        table.setdefault(shape, {}).update(buckets)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(sorted(table.items())), indent=1, sort_keys=True) + "\n")
    clear_caches()
    return path


def bucket(value: int, buckets: Sequence[int]) -> int:
    """The smallest of ``buckets`` (ascending) that holds ``value``; past them, the largest."""
    return next((b for b in buckets if b >= value), buckets[-1])


def tuned(table: dict, shape: str, bucket_key: int | str, default: Config) -> Config:
    """``default`` with the fields ``table[shape][bucket_key]`` sets (an entry may tune a few of
    them); ``default`` itself where the table lacks the shape or bucket. A field the config does
    not have raises ``ValueError`` naming it: a stale file fails loudly, never silently."""
    entry = table.get(shape, {}).get(str(bucket_key))
    if entry is None:
        return default
    unknown = set(entry) - set(default._fields)
    if unknown:
        raise ValueError(f"tuning entry {shape}/{bucket_key} has fields {sorted(unknown)} that "
                         f"{type(default).__name__} lacks ({', '.join(default._fields)})")
    return default._replace(**entry)
