"""Embeddings: which pooling a model asks for (a sentence-transformers folder says, else the
last token, normalised, as vLLM's default for decoder models), and the finishing touches
(Matryoshka truncation, L2 normalisation) on the pooled vector the runner returns."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POOLING_TYPES = ("last", "mean", "cls")
TASKS = ("auto", "generate", "embed")
# sentence-transformers' 1_Pooling/config.json flag -> our pooling type
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_cls_token": "cls"}


@dataclass(frozen=True)
class Pooler:
    """How an embedding model turns a prompt's final hidden states into one vector."""

    pooling_type: str = "last"
    normalize: bool = True
    hidden_size: int = 0
    # Truncations the model was trained for (Matryoshka); None: only its full size.
    matryoshka_dimensions: tuple[int, ...] | None = None

    def finish(self, pooled: list[float], dimensions: int | None = None) -> list[float]:
        """``pooled`` cut to ``dimensions`` (checked with ``check_dimensions``), normalised."""
        vector = pooled[:dimensions] if dimensions else pooled
        if self.normalize:
            norm = math.sqrt(math.fsum(v * v for v in vector)) or 1.0
            vector = [v / norm for v in vector]
        return vector

    def check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None or dimensions == self.hidden_size:
            return
        allowed = self.matryoshka_dimensions
        if allowed is None:
            raise ValueError(f"dimensions must be {self.hidden_size} (this model declares no "
                             f"Matryoshka truncation), got {dimensions}")
        if dimensions not in allowed:
            raise ValueError(f"dimensions must be one of {sorted(allowed)}, got {dimensions}")


def resolve_pooler(path: Path, task: str, pooling_type: str | None, hf_config: Any
                   ) -> Pooler | None:
    """The model's pooler when it embeds: ``task="embed"``, or ``"auto"`` and a
    sentence-transformers folder with a Pooling module; None when it generates."""
    modules = _st_modules(path)
    pooling_dir = next((path / m.get("path", "") for m in modules
                        if m.get("type", "").endswith(".Pooling")), None)
    if task == "generate" or (task == "auto" and pooling_dir is None):
        return None
    kind, normalize = "last", True
    if pooling_dir is not None:
        normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
        settings = json.loads((pooling_dir / "config.json").read_text())
        modes = [ours for flag, ours in _ST_MODES.items() if settings.get(flag)]
        others = [k for k, v in settings.items() if k.startswith("pooling_mode_") and v
                  and k not in _ST_MODES]
        if others or len(modes) != 1:
            raise ValueError(f"{pooling_dir / 'config.json'}: pooling {others or modes} is "
                             f"not supported; supported: {', '.join(POOLING_TYPES)}, one")
        kind = modes[0]
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims is None and getattr(hf_config, "is_matryoshka", False):
        dims = range(1, hf_config.hidden_size + 1)
    return Pooler(pooling_type or kind, normalize, hf_config.hidden_size,
                  tuple(dims) if dims is not None else None)


def _st_modules(path: Path) -> list[dict[str, Any]]:
    file = path / "modules.json" if path.is_dir() else None
    return json.loads(file.read_text()) if file is not None and file.is_file() else []
