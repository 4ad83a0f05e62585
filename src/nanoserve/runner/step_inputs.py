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
                   dummy: bool = False, prefill_tile: int = 0, windows: tuple[int, ...] = (0,)
                   ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None]:
    """Token ids, positions, attention metadata and the rows to sample (None: every row), on
    ``device``. A PENDING_TOKEN gets row ``last_sample_rows[request_id]`` of ``last_samples``.
    ``dummy`` (memory profiling) stores nothing and reads through block 0. With ``prefill_tile``
    (0: none) steps that are not decode-only carry the prefill kernel's work list. A chunk has
    a table per cache group (``windows``: each group's sliding window); with several the
    metadata has a view per group (``AttentionMetadata.group``)."""
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
    num_groups = len(windows)
    width = -(-max(seq_lens) // block_size) if dummy else table_width(chunks)
    tables = block_table_array(chunks, width, block_size, windows)
    decode_only = max(q_lens) == 1
    # Cache slots are found on the host: device ops would cost more to launch than numpy takes.
    order = longest_first(seq_lens) if decode_only else []  # decode takes the longest first
    if dummy:
        slots = np.full(len(ids) * num_groups, -1, dtype=np.int64)
    elif decode_only:
        slots = [first_token_slot(c, block_size, g) for g in range(num_groups) for c in chunks]
    else:
        positions = np.asarray(positions, dtype=np.int64)  # converted once, for both uses
        slots = token_slots(tables, q_lens, positions, block_size)
    with_work = prefill_tile > 0 and not decode_only
    work = prefill_work(q_lens, seq_lens, prefill_tile) if with_work else np.zeros((2, 0), np.int32)
    sample_all = len(last) == len(ids)  # every token ends its chunk and samples: all rows
    starts = list(itertools.accumulate(q_lens, initial=0))
    (ids_t, pos, last_t, pending_at_t, pending_rows_t, slots_t, query_start,
     seq_lens_t, tables_t, order_t, work_t) = packed_to_device(
        [(v, np.int64) for v in (ids, positions, [] if sample_all else last,
                                 pending_at, pending_rows, slots)]
        + [(v, np.int32) for v in (starts, seq_lens, tables.ravel(), order, work.ravel())],
        device)
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


def table_width(chunks: list[SequenceChunk]) -> int:
    """Columns of a step's block tables: the longest chunk's block count (at least 1); a
    chunk's tables, one per cache group, are all as long."""
    return max(1, max(len(c.block_table) for c in chunks))


def group_tables(chunk: SequenceChunk) -> list[list[int]]:
    """The chunk's block table of each cache group."""
    return [chunk.block_table, *chunk.more_tables]


def block_table_array(chunks: list[SequenceChunk], width: int, block_size: int,
                      windows: tuple[int, ...] = (0,)) -> np.ndarray:
    """[chunks, groups, width] int32: each chunk's table per cache group, padded with block 0.
    In a sliding group the blocks before the window of the chunk's first query stay 0 too: no
    kernel reads them (most are freed placeholders), and a long sequence has many."""
    window = max(windows)  # the sliding groups' (one window: see Scheduler)
    slides = [bool(w) for w in windows]
    # The blocks read go into one list (memory copies), to numpy in one conversion, and into
    # place in one scatter: per-row numpy writes would cost a call each.
    values: list[int] = []
    firsts = []
    for c in chunks:
        first = max(0, c.start - window + 1) // block_size if window else 0
        firsts.append(first)
        for sliding, table in zip(slides, group_tables(c)):
            values += table[first:] if sliding and first else table
    blocks = np.fromiter(values, dtype=np.int32, count=len(values))
    if len(values) == len(chunks) * len(windows) * width:  # every run whole: nothing to place
        return blocks.reshape(len(chunks), len(windows), width)
    out = np.zeros((len(chunks), len(windows), width), dtype=np.int32)
    skipped = np.outer(firsts, slides)  # [chunks, groups]: blocks left out before each run
    lengths = (np.array([len(c.block_table) for c in chunks])[:, None] - skipped).ravel()
    starts = np.arange(out.size, step=width) + skipped.ravel()
    at = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(len(values))
    out.reshape(-1)[at] = blocks
    return out


def token_slots(tables: np.ndarray, q_lens: list[int], positions: np.ndarray,
                block_size: int) -> np.ndarray:
    """Every token's cache slot per cache group (group after group, chunk after chunk within):
    the block its position falls in, from its chunk's row of ``tables`` ([chunks, groups,
    width]), and the offset there."""
    rows = np.repeat(np.arange(len(q_lens), dtype=np.int64), q_lens)
    blocks = tables[rows, :, positions // block_size].astype(np.int64)  # [tokens, groups]
    return (blocks.T * block_size + positions % block_size).ravel()


def first_token_slot(chunk: SequenceChunk, block_size: int, group: int = 0) -> int:
    """The cache slot of the chunk's first token (a decode chunk's only one) in cache group
    ``group``'s table."""
    table = chunk.more_tables[group - 1] if group else chunk.block_table
    return table[chunk.start // block_size] * block_size + chunk.start % block_size


def longest_first(seq_lens: list[int]) -> list[int]:
    """Row indices by decreasing length (stable): the order decode kernels take sequences in."""
    return sorted(range(len(seq_lens)), key=seq_lens.__getitem__, reverse=True)
