"""The decode graphs' inputs: one static device arena that a step fills with one copy.

A CUDA graph reads its inputs where it was captured: each graph size has a region of the arena
where a step's inputs are one span, packed in pinned memory (block table column-major, so a
step's columns come first; with several cache groups, each column holds every group's). A row's token is an index into the arena, at the previous step's
sample (the first part, where the graphs' sampler writes) or an uploaded id: samples stay put.
"""
from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np
import torch

from nanoserve.runner.inputs import PENDING_TOKEN, SequenceChunk
from nanoserve.runner.packed_copy import TENSOR_ALIGNMENT, TORCH_DTYPES
from nanoserve.runner.step_inputs import (block_table_array, first_token_slot, longest_first,
                                          table_width, token_slots)


class DecodeRows(NamedTuple):
    """A decode step (one new token per sequence, each sampled) on the host, in batch order."""

    token_ids: np.ndarray  # int64 [n]; PENDING_TOKEN where the previous step's sample goes in
    sample_rows: np.ndarray  # int64 [n]: that sample's row in the previous step's output, or -1
    positions: np.ndarray  # int64 [n]
    slots: np.ndarray  # int64 [groups * n]: cache slot of the new token, group after group
    seq_lens: np.ndarray  # int32 [n]
    order: np.ndarray  # int32 [n]: the rows, longest context first
    tables: np.ndarray  # int32 [n, groups * width]: each group's, padded with block 0

    @classmethod
    def empty(cls, num_groups: int = 1) -> DecodeRows:
        return cls(*(np.empty(0, dtype=np.int64) for _ in range(4)),
                   np.empty(0, dtype=np.int32), np.empty(0, dtype=np.int32),
                   np.zeros((0, num_groups), dtype=np.int32))


def decode_rows(chunks: list[SequenceChunk], block_size: int,
                last_sample_rows: dict[str, int], windows: tuple[int, ...] = (0,)
                ) -> DecodeRows:
    """The rows of a decode step whose chunks are one token each, with a block table per
    cache group (``windows``: each group's sliding window)."""
    width = table_width(chunks)
    token_ids = [c.token_ids[0] for c in chunks]
    starts = [c.start for c in chunks]
    seq_lens = [s + 1 for s in starts]
    return DecodeRows(
        token_ids=np.array(token_ids, dtype=np.int64),
        sample_rows=np.array([last_sample_rows[c.request_id] if t == PENDING_TOKEN else -1
                              for c, t in zip(chunks, token_ids)], dtype=np.int64),
        positions=np.array(starts, dtype=np.int64),
        slots=np.array([first_token_slot(c, block_size, g)
                        for g in range(len(windows)) for c in chunks], dtype=np.int64),
        seq_lens=np.array(seq_lens, dtype=np.int32),
        order=np.array(longest_first(seq_lens), dtype=np.int32),
        tables=block_table_array(chunks, width, block_size, windows).reshape(len(chunks), -1),
    )


def verify_rows(chunks: list[SequenceChunk], block_size: int,
                windows: tuple[int, ...] = (0,)) -> DecodeRows:
    """A verify step as decode rows: every token of every chunk (its last known token, then
    its proposals) a row of its own, whose keys are its sequence's up to and including it, so
    a row attends to the new tokens before it as causal attention would. Tokens are known."""
    tables = block_table_array(chunks, table_width(chunks), block_size, windows)
    q_lens = [len(c.token_ids) for c in chunks]
    positions = np.concatenate([np.arange(c.start, c.start + len(c.token_ids), dtype=np.int64)
                                for c in chunks])
    seq_lens = (positions + 1).astype(np.int32)
    return DecodeRows(
        token_ids=np.concatenate([c.token_ids for c in chunks]).astype(np.int64),
        sample_rows=np.full(len(positions), -1, dtype=np.int64),
        positions=positions,
        slots=token_slots(tables, q_lens, positions, block_size),
        seq_lens=seq_lens,
        order=np.array(longest_first(seq_lens.tolist()), dtype=np.int32),
        tables=tables.reshape(len(chunks), -1).repeat(q_lens, axis=0),
    )


# A region's per-row arrays in their order: name and numpy dtype.
_FIELDS = (("token_ids", np.int64), ("sources", np.int64), ("positions", np.int64),
           ("slots", np.int64), ("temperature", np.float32), ("seq_lens", np.int32),
           ("order", np.int32))
_DTYPES = dict(_FIELDS)


def _aligned(nbytes: int) -> int:
    return nbytes - nbytes % -TENSOR_ALIGNMENT


def _field_bytes(name: str, batch: int, num_groups: int) -> int:
    count = batch * num_groups if name == "slots" else batch  # a slot per row and group
    return _aligned(count * np.dtype(_DTYPES[name]).itemsize)


class GraphRegion:
    """One graph size's inputs: byte offsets in the arena and the device views its graph reads
    (per row, and the sampler's int64 noise seed). ``sources[i]`` is the arena element (int64)
    holding row ``i``'s token id. Rows past a step's batch are padding (see :meth:`pack`).
    ``slots`` and ``tables`` are cache group 0's; ``group_slots``/``group_tables`` every
    group's."""

    @staticmethod
    def size(batch: int, max_blocks: int, num_groups: int = 1) -> int:
        """Bytes of a region for ``batch`` rows and block tables ``max_blocks`` wide."""
        fields = sum(_field_bytes(name, batch, num_groups) for name in _DTYPES)
        return fields + TENSOR_ALIGNMENT + _aligned(max_blocks * num_groups * batch * 4)

    def __init__(self, arena: torch.Tensor, start: int, batch: int, max_blocks: int,
                 num_groups: int = 1):
        self.batch, self.start, self.num_groups = batch, start, num_groups
        starts = itertools.accumulate((_field_bytes(name, batch, num_groups)
                                       for name in _DTYPES), initial=start)
        self.offsets: dict[str, int] = dict(zip([*_DTYPES, "noise_seed"], starts))
        self.tables_start = self.offsets["noise_seed"] + TENSOR_ALIGNMENT
        (self.token_ids, self.sources, self.positions, self.slots, self.temperature,
         self.seq_lens, self.order) = (self._view(arena, name, dtype, batch)
                                       for name, dtype in _FIELDS)
        self.group_slots = self._view(arena, "slots", np.int64,
                                      batch * num_groups).view(num_groups, batch).unbind(0)
        self.noise_seed = self._view(arena, "noise_seed", np.int64, 1)
        nbytes = max_blocks * num_groups * batch * 4
        columns = arena[self.tables_start:self.tables_start + nbytes].view(torch.int32)
        # [batch, max_blocks] per group: a column holds each group's blocks of every row.
        self.group_tables = tuple(columns.view(max_blocks, num_groups, batch)[:, g].T
                                  for g in range(num_groups))
        self.tables = self.group_tables[0]

    def _view(self, arena: torch.Tensor, name: str, dtype, count: int) -> torch.Tensor:
        at = self.offsets[name]
        return arena[at:at + count * np.dtype(dtype).itemsize].view(TORCH_DTYPES[dtype])

    def upload_bytes(self, width: int) -> int:
        """Bytes from ``start`` that hold a step whose block tables are ``width`` wide."""
        return self.tables_start - self.start + width * self.num_groups * self.batch * 4

    def pack(self, host: np.ndarray, rows: DecodeRows, temperature: np.ndarray | None,
             noise_seed: int) -> None:
        """Fill ``host`` (uint8, ``upload_bytes`` long) with this step's span of the region."""
        n, b, groups = len(rows.positions), self.batch, self.num_groups

        def field(name: str, dtype) -> np.ndarray:
            at = self.offsets[name] - self.start
            return host[at:at + b * np.dtype(dtype).itemsize].view(dtype)

        fed = rows.sample_rows >= 0
        own = self.offsets["token_ids"] // 8 + np.arange(b)  # each row's uploaded id
        # Padding rows are greedy, store nothing and read one key of block 0.
        for name, values, pad in (("token_ids", np.where(fed, 0, rows.token_ids), 0),
                                  ("sources", np.where(fed, rows.sample_rows, own[:n]), own[n:]),
                                  ("positions", rows.positions, 0),
                                  ("seq_lens", rows.seq_lens, 1),
                                  ("temperature", np.float32(0.0) if temperature is None
                                   else temperature, 0.0),
                                  ("order", rows.order, np.arange(n, b))):
            out = field(name, _DTYPES[name])
            out[:n], out[n:] = values, pad
        at = self.offsets["slots"] - self.start
        slots = host[at:at + groups * b * 8].view(np.int64).reshape(groups, b)
        slots[:, :n], slots[:, n:] = rows.slots.reshape(groups, n), -1
        at = self.offsets["noise_seed"] - self.start
        host[at:at + 8].view(np.int64)[0] = noise_seed
        width = rows.tables.shape[1] // groups
        at = self.tables_start - self.start
        columns = host[at:at + width * groups * b * 4].view(np.int32).reshape(width, groups, b)
        columns[:, :, :n] = rows.tables.reshape(n, groups, width).transpose(2, 1, 0)
        columns[:, :, n:] = 0


class GraphArena:
    """Static device memory for the last sampled tokens (int64, as many as any step samples),
    then a :class:`GraphRegion` per graph size."""

    def __init__(self, sizes: list[int], max_blocks: int, max_samples: int,
                 device: torch.device, num_groups: int = 1):
        layout, end = self.layout(sizes, max_blocks, max_samples, num_groups)
        self.memory = torch.zeros(end, dtype=torch.uint8, device=device)
        self.int64 = self.memory.view(torch.int64)  # every part is 16-byte aligned
        self.samples = self.int64[:max(max_samples, sizes[-1])]
        self.regions = {bs: GraphRegion(self.memory, at, bs, max_blocks, num_groups)
                        for bs, at in layout.items()}
        self.num_groups = num_groups
        for bs in sizes:  # padding everywhere: what graph capture's warm-up forwards read
            self.stage(bs, DecodeRows.empty(num_groups), None, -1)

    @staticmethod
    def layout(sizes: list[int], max_blocks: int, max_samples: int, num_groups: int = 1
               ) -> tuple[dict[int, int], int]:
        """Each graph size's region start, and the arena's bytes."""
        layout, end = {}, _aligned(8 * max(max_samples, sizes[-1]))
        for bs in sizes:
            layout[bs] = end
            end += GraphRegion.size(bs, max_blocks, num_groups)
        return layout, end

    def stage(self, bs: int, rows: DecodeRows, temperature: np.ndarray | None,
              noise_seed: int) -> GraphRegion:
        """Copy a step's inputs into graph size ``bs``'s region in one asynchronous copy."""
        region = self.regions[bs]
        nbytes = region.upload_bytes(rows.tables.shape[1] // region.num_groups)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.memory.is_cuda)
        region.pack(host.numpy(), rows, temperature, noise_seed)
        self.memory[region.start:region.start + nbytes].copy_(host, non_blocking=True)
        return region
