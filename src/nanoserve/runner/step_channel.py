"""Carries each step from rank 0 to the tensor-parallel workers (shared memory to spawned ones,
gloo broadcasts under torchrun): what shapes the forward, as one flat int64 array, ``[num_chunks,
num_cache_groups, (num_tokens, start, sample, num_blocks, prompt_logprob_rows, num_draft_tokens)
per chunk, token ids, blocks (each chunk's table per group)]``.
"""
from __future__ import annotations

import itertools
import threading
from multiprocessing.context import SpawnContext
from multiprocessing.sharedctypes import RawArray

import numpy as np
import torch
import torch.distributed as dist

from nanoserve.runner.inputs import SequenceChunk, StepInput

_CLOSE = -1
_FIELDS = 6  # per-chunk header entries
_POLL_S = 0.1  # how often rank 0, waiting on its workers, checks whether one has died


def pack_step(step: StepInput) -> np.ndarray:
    chunks = step.chunks
    head = [len(chunks), 1 + len(chunks[0].more_tables) if chunks else 1]
    for c in chunks:
        head += (len(c.token_ids), c.start, int(c.sample), len(c.block_table),
                 c.prompt_logprob_rows, c.num_draft_tokens)
    body = itertools.chain(head, *(c.token_ids for c in chunks),
                           *(t for c in chunks for t in (c.block_table, *c.more_tables)))
    return np.fromiter(body, dtype=np.int64)


def packed_step_bound(max_num_seqs: int, max_num_batched_tokens: int, max_blocks_per_seq: int
                      ) -> int:
    """The most int64 words a packed step can take under these scheduler limits."""
    return 2 + _FIELDS * max_num_seqs + max_num_batched_tokens + max_num_seqs * max_blocks_per_seq


def unpack_step(values: list[int]) -> StepInput:
    """The step a worker runs: the forward's inputs, with no sampling state (params None)."""
    num_chunks, num_groups = values[0], values[1]
    heads = values[2:2 + _FIELDS * num_chunks]
    token_at = 2 + _FIELDS * num_chunks
    block_at = token_at + sum(heads[0::_FIELDS])
    chunks = []
    for i in range(num_chunks):
        (num_tokens, start, sample, num_blocks, prompt_rows,
         num_drafts) = heads[_FIELDS * i:_FIELDS * (i + 1)]
        tables = [values[block_at + g * num_blocks:block_at + (g + 1) * num_blocks]
                  for g in range(num_groups)]
        chunks.append(SequenceChunk(
            str(i), values[token_at:token_at + num_tokens], start,
            tables[0], bool(sample), None, [], [], [],
            prompt_rows, num_drafts, tables[1:]))
        token_at += num_tokens
        block_at += num_groups * num_blocks
    return StepInput(chunks)


class SharedMemoryStepChannel:
    """One shared-memory slot that rank 0 writes each step into and its same-host workers read,
    with a semaphore post per worker. Rank 0 waits for each ``done``, writes, posts each ``ready``,
    and raises once ``abandoned`` (its watchdog's event) is set. Workers set ``rank``."""

    def __init__(self, ctx: SpawnContext, num_workers: int, capacity: int,
                 abandoned: threading.Event):
        self.capacity = capacity
        self.slot = RawArray("q", capacity + 1)  # [payload length or _CLOSE, payload...]
        self.ready = [ctx.Semaphore(0) for _ in range(num_workers)]
        self.done = [ctx.Semaphore(1) for _ in range(num_workers)]
        self.rank = 0
        self.abandoned: threading.Event | None = abandoned

    def __getstate__(self) -> dict:  # an Event does not cross processes; workers need none
        return {**self.__dict__, "abandoned": None}

    def send(self, step: StepInput | None) -> None:
        payload = None if step is None else pack_step(step)
        if payload is not None and len(payload) > self.capacity:
            raise ValueError(f"a step of {len(payload)} words exceeds the channel's "
                             f"{self.capacity}")
        for done in self.done:
            while not done.acquire(timeout=_POLL_S):
                if self.abandoned.is_set():
                    raise RuntimeError("a tensor-parallel worker stopped reading steps")
        words = np.frombuffer(self.slot, dtype=np.int64)
        words[0] = _CLOSE if payload is None else len(payload)
        if payload is not None:
            words[1:1 + len(payload)] = payload
        for ready in self.ready:
            ready.release()

    def recv(self) -> StepInput | None:
        self.ready[self.rank - 1].acquire()
        words = np.frombuffer(self.slot, dtype=np.int64)
        length = int(words[0])
        values = None if length == _CLOSE else words[1:1 + length].tolist()  # a copy
        self.done[self.rank - 1].release()
        return None if values is None else unpack_step(values)


class GlooStepChannel:
    """Gloo broadcasts of each step to ranks torchrun started: the payload's length (-1: close),
    then the payload. Create on all ranks together."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo")
        self.header = torch.zeros(1, dtype=torch.int64)

    def send(self, step: StepInput | None) -> None:
        payload = None if step is None else torch.from_numpy(pack_step(step))
        self.header[0] = _CLOSE if payload is None else payload.numel()
        dist.broadcast(self.header, src=0, group=self.group)
        if payload is not None:
            dist.broadcast(payload, src=0, group=self.group)

    def recv(self) -> StepInput | None:
        dist.broadcast(self.header, src=0, group=self.group)
        length = int(self.header[0])
        if length == _CLOSE:
            return None
        payload = torch.empty(length, dtype=torch.int64)
        dist.broadcast(payload, src=0, group=self.group)
        return unpack_step(payload.tolist())


# Rank 0 sends each step (None: close); a worker receives it (None: closed).
StepChannel = SharedMemoryStepChannel | GlooStepChannel
