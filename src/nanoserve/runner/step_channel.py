"""Carries each step from rank 0 to the tensor-parallel workers as one broadcast int64 tensor.

A worker only needs what shapes the forward: per chunk, its token ids, start position, block
table and whether it ends in a sampled token. Sampling parameters, request ids and histories
stay on rank 0, which alone samples. The step is packed into one flat tensor (no pickling):

    [num_chunks, (num_tokens, start, sample, num_blocks) per chunk, all token ids, all blocks]

preceded by a one-element header broadcast that carries the payload's length (-1: close).
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from nanoserve.runner.inputs import SequenceChunk, StepInput

_CLOSE = -1
_FIELDS = 4  # per-chunk header entries


def pack_step(step: StepInput) -> torch.Tensor:
    chunks = step.chunks
    head = [len(chunks)]
    for c in chunks:
        head += (len(c.token_ids), c.start, int(c.sample), len(c.block_table))
    body = itertools.chain(head, *(c.token_ids for c in chunks),
                           *(c.block_table for c in chunks))
    return torch.tensor(list(body), dtype=torch.int64)


def unpack_step(packed: torch.Tensor) -> StepInput:
    """The step a worker runs: the forward's inputs, with no sampling state (params None)."""
    values = packed.tolist()
    num_chunks = values[0]
    heads = values[1:1 + _FIELDS * num_chunks]
    token_at = 1 + _FIELDS * num_chunks
    block_at = token_at + sum(heads[0::_FIELDS])
    chunks = []
    for i in range(num_chunks):
        num_tokens, start, sample, num_blocks = heads[_FIELDS * i:_FIELDS * (i + 1)]
        chunks.append(SequenceChunk(
            str(i), values[token_at:token_at + num_tokens], start,
            values[block_at:block_at + num_blocks], bool(sample), None, [], [], []))
        token_at += num_tokens
        block_at += num_blocks
    return StepInput(chunks)


class StepChannel:
    """Rank 0 sends steps (or close), every other rank receives them; collective calls.

    Runs over its own gloo group whatever the model's backend: steps are built and read on the
    host, so a CPU transport avoids two device copies and a sync per step, and reaches
    workers on other machines as well as local ones. Must be created on all ranks together.
    """

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo")
        self.header = torch.zeros(1, dtype=torch.int64)

    def send(self, step: StepInput | None) -> None:
        payload = None if step is None else pack_step(step)
        self.header[0] = _CLOSE if payload is None else payload.numel()
        dist.broadcast(self.header, src=0, group=self.group)
        if payload is not None:
            dist.broadcast(payload, src=0, group=self.group)

    def recv(self) -> StepInput | None:
        """The next step, or None when rank 0 closes."""
        dist.broadcast(self.header, src=0, group=self.group)
        length = int(self.header[0])
        if length == _CLOSE:
            return None
        payload = torch.empty(length, dtype=torch.int64)
        dist.broadcast(payload, src=0, group=self.group)
        return unpack_step(payload)
