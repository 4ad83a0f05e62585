"""The worker side of tensor parallelism (distributed.py): ranks 1..N-1 run their shard of every
step until rank 0 closes; spawned ones report "up" or their error to rank 0 and die with it."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from nanoserve.config import EngineConfig, ModelConfig
from nanoserve.gc_tuning import freeze_startup_heap
from nanoserve.layers.parallel_state import tensor_parallel_group
from nanoserve.runner.device import resolve_device
from nanoserve.runner.model_runner import ModelRunner
from nanoserve.runner.step_channel import SharedMemoryStepChannel, StepChannel


def rank_device(name: str, local_rank: int) -> torch.device:
    """The CPU, or this host's ``local_rank``-th visible GPU (pick them: CUDA_VISIBLE_DEVICES)."""
    device = resolve_device(name)
    if device.type != "cuda":
        return device
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def build_runner(config: EngineConfig, model_config: ModelConfig, path: Path, rank: int,
                 size: int, device: torch.device,
                 draft_model_config: ModelConfig | None = None) -> ModelRunner:
    """Rank ``rank``'s model runner: its layers shard themselves as they are built; a draft
    model that rank 0 runs beside it takes its share of the cache budget."""
    with tensor_parallel_group(rank, size):
        return ModelRunner(config, model_config, path, device, draft_model_config)


def leave_process_group(backend: str, abort: bool) -> None:
    """Leave this process's torch.distributed group, if any. NCCL's is aborted: its orderly
    destroy can hang once CUDA graphs captured its collectives."""
    if not dist.is_initialized():
        return
    if abort or backend == "nccl":
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()


def serve(config: EngineConfig, model_config: ModelConfig, path: Path, rank: int, size: int,
          device: torch.device, channel: StepChannel) -> None:
    """A worker's life once in the group: build its shard, run rank 0's steps until close
    (its collectives come in rank 0's order: the runner's start-up, then each step's)."""
    runner = build_runner(config, model_config, path, rank, size, device)
    freeze_startup_heap()
    while (step := channel.recv()) is not None:
        runner.launch(step)
    runner.close()
    leave_process_group(backend_for(device), abort=False)


def _exit_with_parent(parent_alive: Connection) -> None:
    """Thread: rank 0 never writes to this pipe, so EOF means its process is gone."""
    with contextlib.suppress(EOFError):
        parent_alive.recv()
    os._exit(0)


def worker_main(rank: int, size: int, config: EngineConfig, model_config: ModelConfig,
                path: Path, store_port: int, channel: SharedMemoryStepChannel,
                report: Connection, parent_alive: Connection) -> None:
    """Entry point of a spawned worker: join rank 0's store and group, then serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: rank 0 decides
    threading.Thread(target=_exit_with_parent, args=(parent_alive,), daemon=True).start()
    try:
        device = rank_device(config.device, rank)  # its runner takes its share of CPU threads
        store = dist.TCPStore("127.0.0.1", store_port, size, is_master=False)
        report.send(("up", ""))
        dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=size)
        channel.rank = rank
        serve(config, model_config, path, rank, size, device, channel)
    except BaseException as exc:
        report.send(("error", f"rank {rank} failed with {type(exc).__name__}: {exc}\n"
                              f"{traceback.format_exc()}"))
        os._exit(1)  # skip atexit hooks: tearing down a group with a failed peer can hang
