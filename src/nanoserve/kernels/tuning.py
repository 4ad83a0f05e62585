"""Kernel launch configurations as data: ``configs/<op>/<device>.json`` beside this file holds
``{shape key: {row bucket: entry}}``, written by ``nanoserve tune MODEL``, read by an op's
``select`` (:func:`load_table`), which has its own heuristic for shapes it lacks."""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).with_name("configs")


@functools.cache  # an op's select asks on every eager call: the driver is asked once
def device_key(device: torch.device) -> str:
    """The file name a device's tunings go under, e.g. ``NVIDIA_H200``."""
    return re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name(device)).strip("_")


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
    _load.cache_clear()
    return path
