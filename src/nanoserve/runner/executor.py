"""Chooses how model steps run: in this process, or across tensor-parallel worker processes."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from nanoserve.config import EngineConfig, ModelConfig
from nanoserve.runner.cpu_threads import default_cpu_threads, per_rank_threads
from nanoserve.runner.device import resolve_device

logger = logging.getLogger(__name__)


def make_executor(config: EngineConfig, model_config: ModelConfig, path: Path,
                  draft_model_config: ModelConfig | None = None):
    """``draft_model_config``: a draft model whose cache will hold as many blocks as this
    one's, so that this cache leaves it the memory (on rank 0, which runs it). On the CPU the
    thread count is settled here, once, for every rank to take its share of."""
    if resolve_device(config.device).type == "cpu":
        if config.cpu_threads is None:
            config = dataclasses.replace(config, cpu_threads=default_cpu_threads())
        else:
            logger.info("CPU threads: %d (cpu_threads)", config.cpu_threads)
    if config.tensor_parallel_size == 1:
        from nanoserve.runner.model_runner import ModelRunner
        return ModelRunner(config, model_config, path, draft_model_config=draft_model_config)
    from nanoserve.runner.distributed import TensorParallelExecutor
    return TensorParallelExecutor(config, model_config, path, draft_model_config)


def make_draft_executor(config: EngineConfig, target, path: Path, model_config: ModelConfig):
    """A draft model's runner: whole, in this process (beside a tensor-parallel target, rank
    0's), with as many blocks as the target's cache (it never runs out first) and rank 0's
    share of the CPU threads."""
    from nanoserve.runner.model_runner import ModelRunner

    threads = getattr(target, "runner", target).config.cpu_threads
    draft = dataclasses.replace(
        config, model=str(path), speculative_config=None, num_kv_blocks=target.num_kv_blocks,
        disable_hybrid_kv_cache_manager=True,  # the proposer keeps one table a sequence
        kv_cache_memory=None, tensor_parallel_size=1,
        cpu_threads=None if threads is None else per_rank_threads(
            threads, config.tensor_parallel_size))
    return ModelRunner(draft, model_config, path)
