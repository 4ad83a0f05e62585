"""Chooses how model steps run: in this process, or across tensor-parallel worker processes."""
from __future__ import annotations

from pathlib import Path

from nanoserve.config import EngineConfig, ModelConfig


def make_executor(config: EngineConfig, model_config: ModelConfig, path: Path,
                  draft_model_config: ModelConfig | None = None):
    """``draft_model_config``: a draft model whose cache will hold as many blocks as this
    one's, so that this cache leaves it the memory (one rank only)."""
    if config.tensor_parallel_size == 1:
        from nanoserve.runner.model_runner import ModelRunner
        return ModelRunner(config, model_config, path, draft_model_config=draft_model_config)
    from nanoserve.runner.distributed import TensorParallelExecutor
    return TensorParallelExecutor(config, model_config, path)
