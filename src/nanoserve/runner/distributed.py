"""Tensor parallelism across processes: rank 0 is the engine's executor, ranks 1..N-1 follow it
(tp_worker.py). Each rank holds its shard of the model and KV cache; rank 0 hands each step to
the workers over a step channel (step_channel.py), all run the forward, rank 0 alone samples.

By default rank 0 spawns the workers, which read steps from shared memory and report errors
over a pipe; a watchdog kills the rest when one dies, so no collective hangs. Under torchrun,
ranks but 0 serve from the executor's constructor; steps go as gloo broadcasts.
"""
from __future__ import annotations

import contextlib
import multiprocessing.spawn as mp_spawn
import os
import threading
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, TypeVar
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanoserve.attention.backend import select_backend
from nanoserve.attention.cache_spec import cache_groups
from nanoserve.config import EngineConfig, ModelConfig, max_model_len
from nanoserve.layers.parallel_state import tensor_parallel_group
from nanoserve.models.registry import build_model
from nanoserve.runner.inputs import CompletedStep, InFlightStep, StepInput
from nanoserve.runner.model_runner import ModelRunner
from nanoserve.runner.step_channel import (GlooStepChannel, SharedMemoryStepChannel,
                                            StepChannel, packed_step_bound)
from nanoserve.runner.tp_worker import (backend_for, build_runner, leave_process_group,
                                        rank_device, serve, worker_main)

TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
JOIN_TIMEOUT_S = 30.0
PEER_EXIT_WAIT_S = 1.0  # how long a failed step waits to learn whether a worker died
T = TypeVar("T")


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed; the message carries the worker's own traceback."""


def check_shardable(model_config: ModelConfig, size: int) -> None:
    """Raise the shape errors every rank would hit (heads, features not divisible by
    ``size``) before any worker starts: the layers' own checks, on a model with no storage."""
    with tensor_parallel_group(0, size), torch.device("meta"):
        build_model(model_config, select_backend(torch.device("cpu")))


@contextlib.contextmanager
def _main_not_rerun() -> Iterator[None]:
    """Workers spawned inside run nanoserve's code alone. multiprocessing would first re-run
    the parent's ``__main__`` in each: a script without an ``if __name__ == "__main__":``
    guard would start an engine of its own there, one read from stdin cannot be re-run."""
    prepare = mp_spawn.get_preparation_data

    def without_main(name: str) -> dict[str, Any]:
        data = prepare(name)
        data.pop("init_main_from_name", None)
        data.pop("init_main_from_path", None)
        return data

    mp_spawn.get_preparation_data = without_main  # looked up there at each Process.start
    try:
        yield
    finally:
        mp_spawn.get_preparation_data = prepare


class TensorParallelExecutor:
    """Rank 0 of a tensor-parallel group, with a ModelRunner's interface: runs its shard, drives
    and owns the workers and this process's group. Steps never feed back device tokens."""

    feeds_pending_tokens = False

    def __init__(self, config: EngineConfig, model_config: ModelConfig, path: Path,
                 draft_model_config: ModelConfig | None = None):
        self.size = config.tensor_parallel_size
        self.workers: list[BaseProcess] = []
        self.reports: list[Connection] = []
        self.up: set[int] = set()
        self.errors: list[str] = []
        self.dead: list[tuple[int, int]] = []  # (rank, exit code) first seen by the watchdog
        self.failed = threading.Event()
        self._stopped = False  # closed, or stopped after a failure: workers may exit now
        self._parent_alive: Connection | None = None
        self._store: dist.TCPStore | None = None
        self._group_lock = threading.Lock()
        self.runner: ModelRunner | None = None
        self.channel: StepChannel
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group "
                               "(another tensor-parallel engine?); close that one first")
        check_shardable(model_config, self.size)
        if all(name in os.environ for name in TORCHRUN_VARS):
            self._join_torchrun(config, model_config, path)
        else:
            self._spawn(config, model_config, path)
        self.runner = self._guarded(
            lambda: build_runner(config, model_config, path, 0, self.size, self.device,
                                 draft_model_config))
        self.num_kv_blocks = self.runner.num_kv_blocks
        self.cache_groups = self.runner.cache_groups

    def _join_torchrun(self, config: EngineConfig, model_config: ModelConfig, path: Path) -> None:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != self.size:
            raise ValueError(f"tensor_parallel_size ({self.size}) must equal torchrun's "
                             f"WORLD_SIZE ({world})")
        self.device = rank_device(config.device, int(os.environ.get("LOCAL_RANK", rank)))
        self.backend = backend_for(self.device)
        dist.init_process_group(self.backend, init_method="env://", rank=rank, world_size=world)
        self.channel = GlooStepChannel()
        if rank > 0:
            serve(config, model_config, path, rank, world, self.device, self.channel)
            raise SystemExit(0)

    def _spawn(self, config: EngineConfig, model_config: ModelConfig, path: Path) -> None:
        self.device = rank_device(config.device, 0)
        self.backend = backend_for(self.device)
        if self.device.type == "cuda" and torch.cuda.device_count() < self.size:
            raise ValueError(f"tensor_parallel_size {self.size} needs {self.size} GPUs, "
                             f"{torch.cuda.device_count()} are visible")
        # Port 0: the OS picks a free one. Held until the group is left: the group runs through it.
        self._store = dist.TCPStore("127.0.0.1", 0, self.size, is_master=True,
                                    wait_for_workers=False)
        ctx = mp.get_context("spawn")
        blocks_per_seq = -(-max_model_len(config, model_config) // config.block_size) \
            * cache_groups(model_config.layer_windows,
                           not config.disable_hybrid_kv_cache_manager).num_groups
        self.channel = SharedMemoryStepChannel(
            ctx, self.size - 1, packed_step_bound(config.max_num_seqs,
                                                  config.max_num_batched_tokens, blocks_per_seq),
            abandoned=self.failed)
        alive_r, self._parent_alive = ctx.Pipe(duplex=False)
        with _main_not_rerun():
            for rank in range(1, self.size):
                report_r, report_w = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=worker_main, name=f"nanoserve-tp{rank}", daemon=True,
                                   args=(rank, self.size, config, model_config, path,
                                         self._store.port, self.channel, report_w, alive_r))
                proc.start()
                report_w.close()
                self.workers.append(proc)
                self.reports.append(report_r)
        alive_r.close()
        self._guarded(self._join_workers)
        threading.Thread(target=self._watch, name="nanoserve-tp-watchdog", daemon=True).start()

    def _join_workers(self) -> None:
        """Join the group once every worker is about to, so that one failing to start (import,
        device, store) raises here instead of leaving rank 0 in the rendezvous."""
        while len(self.up) < len(self.workers):
            if self.errors or any(not p.is_alive() for p in self.workers):
                raise WorkerError("a tensor-parallel worker failed to start")
            wait([c for c in self.reports if not c.closed] + [p.sentinel for p in self.workers])
            self._read_reports()
        dist.init_process_group(self.backend, store=self._store, rank=0, world_size=self.size)

    def _read_reports(self) -> None:
        for rank, conn in enumerate(self.reports, start=1):
            while not conn.closed and conn.poll():
                try:
                    kind, text = conn.recv()
                except EOFError:  # the worker has exited
                    conn.close()
                    break
                if kind == "up":
                    self.up.add(rank)
                else:
                    self.errors.append(text)

    def _watch(self) -> None:
        """Daemon thread: a worker that exits while the group runs must not hang rank 0."""
        exited = wait([p.sentinel for p in self.workers])
        if self._stopped:
            return
        for proc in self.workers:
            if proc.sentinel in exited:
                proc.join()  # its sentinel closes before its exit status can be read
        self.dead = self._dead_workers()
        self.failed.set()
        for proc in self.workers:  # collectives with dead peers fail (gloo) rather than wait
            proc.kill()
        if self.backend == "nccl":  # NCCL would wait forever: abort its communicators
            self._leave_group(abort=True)

    def _guarded(self, fn: Callable[[], T], own_failure: Callable[[], bool] = lambda: False
                 ) -> T:
        """fn() on rank 0; a failure anywhere stops the group and raises, naming its cause,
        but an exception that ``own_failure()`` says is rank 0's alone (its peers still in
        step, alive) only raises: the engine then fails the request at fault."""
        if self._stopped:
            raise RuntimeError("the tensor-parallel group is no longer running (closed, or "
                               "stopped by an earlier failure)")
        try:
            result = fn()
        except BaseException as exc:
            if isinstance(exc, Exception) and own_failure() and not self.failed.is_set():
                raise
            error = self._fail()
            if error is None:
                raise
            raise error from exc
        if self.failed.is_set():  # an aborted NCCL collective may return garbage, not raise
            raise self._fail() or WorkerError("a tensor-parallel worker exited unexpectedly")
        return result

    def _dead_workers(self) -> list[tuple[int, int]]:
        return [(rank, p.exitcode) for rank, p in enumerate(self.workers, start=1)
                if p.exitcode is not None]

    def _fail(self) -> WorkerError | None:
        """Stop everything after a failure; the workers' own errors, if they reported any."""
        if not self.errors:
            # A collective can fail on a dead peer's closed socket before the watchdog has
            # reaped that peer; the watchdog alone reaps, so that two threads never race for it.
            self.failed.wait(PEER_EXIT_WAIT_S)
        dead = self.dead or self._dead_workers()  # before _stop kills the rest
        self._stop(graceful=False)
        if self.errors:
            return WorkerError("tensor-parallel worker failed: " + "\n".join(self.errors))
        if dead:
            return WorkerError(", ".join(f"tensor-parallel worker rank {rank} exited with code "
                                         f"{code}" for rank, code in dead) + " (see its stderr)")
        return None

    @property
    def stopped(self) -> bool:
        """True once no step can run: closed, or a worker died (seen by the watchdog even
        while no step runs, so an idle engine learns of it too)."""
        return self._stopped or self.failed.is_set()

    def launch(self, step: StepInput) -> InFlightStep:
        return self._guarded(lambda: self._step(step),
                             own_failure=lambda: self.runner.collectives_done)

    def _step(self, step: StepInput) -> InFlightStep:
        self.channel.send(step)
        # Waited for inside the guard, which discards what a collective aborted may return.
        return CompletedStep(self.runner.launch(step).result())

    def close(self) -> None:
        self._stop(graceful=True)

    def _stop(self, graceful: bool) -> None:
        """Stop the workers (asking them first when graceful) and leave the process group."""
        if self._stopped:
            return
        self._stopped = True  # from here on, workers exiting is expected: the watchdog stands down
        timeout = 0.0
        if graceful and not self.failed.is_set():
            try:
                self.channel.send(None)
                timeout = JOIN_TIMEOUT_S
            except RuntimeError:  # a worker died just now: no one to ask, kill the rest below
                pass
        deadline = time.monotonic() + timeout
        for proc in self.workers:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._read_reports()  # the workers' last words, before their pipes close
        for conn in self.reports:
            conn.close()
        if self.runner is not None:
            self.runner.close()
        self._leave_group(abort=not graceful)
        self._store = None
        if self._parent_alive is not None:
            self._parent_alive.close()

    def _leave_group(self, abort: bool) -> None:
        # Both the watchdog and the main thread may get here: one of them tears down.
        with self._group_lock:
            leave_process_group(self.backend, abort)
