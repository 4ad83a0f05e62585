"""A step's sequence chunks as model inputs: token ids, positions and attention metadata."""
from __future__ import annotations

import itertools

import numpy as np
import torch

from nanoserve.attention.metadata import AttentionMetadata
from nanoserve.attention.prefill_work import prefill_work
from nanoserve.runner.inputs import PENDING_TOKEN, SequenceChunk
from nanoserve.runner.packed_copy import packed_to_device


def prepare_inputs(chunks: list[SequenceChunk], block_size: int, device: torch.device,
                   last_samples: torch.Tensor | None, last_sample_rows: dict[str, int],
                   dummy: bool = False, prefill_tile: int = 0, num_groups: int = 1
                   ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None]:
    """Token ids, positions, attention metadata and the rows to sample (None: every row), on
    ``device``. A PENDING_TOKEN gets row ``last_sample_rows[request_id]`` of ``last_samples``.
    ``dummy`` (memory profiling) stores nothing and reads through block 0. With ``prefill_tile``
    (0: none) steps that are not decode-only carry the prefill kernel's work list. A chunk's
    ``block_table`` holds ``num_groups`` cache groups' tables back to back; the metadata then
    has a view per group (``AttentionMetadata.group``)."""
    ids: list[int] = []
    positions: list[int] | np.ndarray = []
    q_lens, seq_lens, last = [], [], []
    pending_at, pending_rows = [], []
    for c in chunks:
        n = len(c.token_ids)
        ids += c.token_ids
        positions += range(c.start, c.start + n)
        q_lens.append(n)
        seq_lens.append(c.start + n)
        if c.sample:  # a verify samples at its proposals and the token before them too
            last += range(len(ids) - 1 - c.num_draft_tokens, len(ids))
        if c.token_ids[-1] == PENDING_TOKEN:
            pending_at.append(len(ids) - 1)
            pending_rows.append(last_sample_rows[c.request_id])
    width = -(-max(seq_lens) // block_size) if dummy else table_width(chunks, num_groups)
    tables = padded_block_tables(chunks, width, num_groups)
    decode_only = max(q_lens) == 1
    # Cache slots are found on the host: device ops would cost more to launch than numpy takes.
    order = longest_first(seq_lens) if decode_only else []  # decode takes the longest first
    if dummy:
        slots = np.full(len(ids) * num_groups, -1, dtype=np.int64)
    elif decode_only:
        slots = [first_token_slot(c, block_size, g, num_groups)
                 for g in range(num_groups) for c in chunks]
    else:
        positions = np.asarray(positions, dtype=np.int64)  # converted once, for both uses
        slots = token_slots(tables, width, q_lens, positions, block_size, num_groups)
    with_work = prefill_tile > 0 and not decode_only
    work = prefill_work(q_lens, seq_lens, prefill_tile) if with_work else np.zeros((2, 0), np.int32)
    sample_all = len(last) == len(ids)  # every token ends its chunk and samples: all rows
    starts = list(itertools.accumulate(q_lens, initial=0))
    (ids_t, pos, last_t, pending_at_t, pending_rows_t, slots_t, query_start,
     seq_lens_t, tables_t, order_t, work_t) = packed_to_device(
        [(v, np.int64) for v in (ids, positions, [] if sample_all else last,
                                 pending_at, pending_rows, slots)]
        + [(v, np.int32) for v in (starts, seq_lens, tables, order, work.ravel())], device)
    if pending_at == pending_rows == list(range(len(ids))):
        ids_t = last_samples[:len(ids)]  # each token is the previous step's sample, in order
    elif pending_at:
        ids_t[pending_at_t] = last_samples[pending_rows_t]
    meta = AttentionMetadata(query_start_loc=query_start, seq_lens=seq_lens_t,
                             slot_mapping=slots_t[:len(ids)],
                             block_tables=tables_t.view(len(chunks), num_groups, width)[:, 0],
                             max_query_len=max(q_lens), max_seq_len=max(seq_lens),
                             seq_order=order_t if decode_only else None,
                             prefill_work=work_t.view(2, -1) if with_work else None)
    if num_groups > 1:
        meta = meta.with_groups(tables_t.view(len(chunks), num_groups, width).unbind(1),
                                slots_t.view(num_groups, len(ids)).unbind(0))
    return ids_t, pos, meta, None if sample_all else last_t


def table_width(chunks: list[SequenceChunk], num_groups: int = 1) -> int:
    """Columns of a step's block table (per cache group): the longest chunk's block count (at
    least 1)."""
    return max(1, max(len(c.block_table) for c in chunks) // num_groups)


def padded_block_tables(chunks: list[SequenceChunk], width: int, num_groups: int = 1
                        ) -> list[int]:
    """Every chunk's block table (each of its ``num_groups`` tables) padded with block 0 to
    ``width`` blocks, back to back."""
    tables: list[int] = []
    for c in chunks:
        n = len(c.block_table) // num_groups
        for g in range(num_groups):
            tables += c.block_table[g * n:(g + 1) * n] if num_groups > 1 else c.block_table
            tables += [0] * (width - n)
    return tables


def token_slots(tables: list[int], width: int, q_lens: list[int], positions: np.ndarray,
                block_size: int, num_groups: int = 1) -> np.ndarray:
    """Every token's cache slot, chunk after chunk (per cache group, group after group): the
    block its position falls in, from its chunk's row of the padded ``tables`` (``width``
    blocks a group's row), and the offset there."""
    rows = np.repeat(np.arange(len(q_lens), dtype=np.int64) * width * num_groups, q_lens)
    table = np.asarray(tables, dtype=np.int64)
    offsets = positions % block_size
    return np.concatenate([table[rows + g * width + positions // block_size] * block_size
                           + offsets for g in range(num_groups)])


def first_token_slot(chunk: SequenceChunk, block_size: int, group: int = 0,
                     num_groups: int = 1) -> int:
    """The cache slot of the chunk's first token (a decode chunk's only one) in cache group
    ``group``'s table."""
    at = group * (len(chunk.block_table) // num_groups) + chunk.start // block_size
    return chunk.block_table[at] * block_size + chunk.start % block_size


def longest_first(seq_lens: list[int]) -> list[int]:
    """Row indices by decreasing length (stable): the order decode kernels take sequences in."""
    return sorted(range(len(seq_lens)), key=seq_lens.__getitem__, reverse=True)
