"""Chooses how model steps run: in this process, or across tensor-parallel worker processes."""
from __future__ import annotations

from pathlib import Path

from nanoserve.config import EngineConfig, ModelConfig


def make_executor(config: EngineConfig, model_config: ModelConfig, path: Path):
    if config.tensor_parallel_size == 1:
        from nanoserve.runner.model_runner import ModelRunner
        return ModelRunner(config, model_config, path)
    from nanoserve.runner.distributed import TensorParallelExecutor
    return TensorParallelExecutor(config, model_config, path)
