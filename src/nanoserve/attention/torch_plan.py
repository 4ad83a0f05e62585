"""The PyTorch attention backend's layout of one forward's batch, worked out once on the host
from the metadata and read by every layer: sequences grouped by query count and context length
(each group attended on padded dense tensors), the cache slots to store into, the positions'
rotary factors and, per group, where its queries sit, which cache blocks hold its keys and
which keys each query sees.

A group of one sequence whose blocks are consecutive in the cache (the usual case for a lone
sequence) reads its keys in place, as a view, instead of gathering them; one whose queries see
every key it reads (a decode step) needs no mask."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from nanoserve.attention.metadata import AttentionMetadata
from nanoserve.layers.rotary import RopeRows, rope_rows


@dataclass
class GroupPlan:
    """Sequences of like query count and context length, padded to ``max_q`` queries and
    ``max_kv`` keys."""

    q_lens: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64
    max_q: int
    max_kv: int
    q_span: tuple[int, int] | None  # its tokens, when they are one run of whole rows
    q_index: torch.Tensor | None  # [B, max_q]: each padded query's token (with no q_span)
    q_valid: torch.Tensor | None  # [B, max_q] bool: real queries (None: all of them)
    tokens: torch.Tensor | None  # its tokens in packed order (None: the step's, all of them)
    blocks: torch.Tensor | None  # [B, blocks] cache blocks to gather (None: in place)
    first_block: int  # with blocks None: the run of blocks holding the sequence's keys
    empty_context: bool  # a sequence without keys (its output is zero)
    block_size: int
    _visible: dict[int, tuple[int, torch.Tensor | None]] = field(default_factory=dict)

    @property
    def batch(self) -> int:
        return self.q_lens.shape[0]

    def visibility(self, window: int) -> tuple[int, torch.Tensor | None]:
        """(the first key position read, ``[B, max_q, keys]`` which keys each query sees, or
        None when each sees every key read): causal, within ``window`` (> 0)."""
        if window not in self._visible:
            start = 0
            if window > 0:  # skip the keys out of every query's window (gathered: whole blocks)
                start = max(0, int((self.seq_lens - self.q_lens).min()) + 1 - window)
                if self.blocks is not None:
                    start -= start % self.block_size
            device = self.q_lens.device
            kv_pos = torch.arange(start, self.max_kv, device=device)
            q_pos = torch.arange(self.max_q, device=device)
            q_abs = (self.seq_lens - self.q_lens)[:, None] + q_pos[None, :]
            mask = (kv_pos[None, None, :] <= q_abs[:, :, None]) \
                & (kv_pos[None, None, :] < self.seq_lens[:, None, None])
            if window > 0:
                mask &= kv_pos[None, None, :] > q_abs[:, :, None] - window
            self._visible[window] = (start, None if bool(mask.all()) else mask)
        return self._visible[window]

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """``[B, max_q, H, D]``: the group's queries, padded."""
        if self.q_span is not None:
            return q[self.q_span[0]:self.q_span[1]].view(self.batch, self.max_q, *q.shape[1:])
        return q[self.q_index]

    def keys(self, cache: torch.Tensor, start: int, dtype: torch.dtype) -> torch.Tensor:
        """``[B, Hkv, keys, D]`` in ``dtype``: positions ``start..max_kv`` of each sequence."""
        block_size, num_kv_heads = cache.shape[1:3]
        if self.blocks is None:
            count = -(-self.max_kv // block_size)
            rows = cache[self.first_block:self.first_block + count].flatten(0, 1)
            return cast(rows[start:self.max_kv], dtype).unsqueeze(0).transpose(1, 2)
        blocks = self.blocks[:, start // block_size:].reshape(-1)  # start: a block's first
        # Into a given tensor: PyTorch's CPU index_select is several times faster with out=.
        pages = cache.new_empty((len(blocks),) + cache.shape[1:])
        torch.index_select(cache, 0, blocks, out=pages)
        pages = pages.view(self.batch, -1, num_kv_heads, cache.shape[-1])  # MLA: v narrower
        return cast(pages[:, :self.max_kv - start], dtype).transpose(1, 2)

    def packed(self, out: torch.Tensor) -> torch.Tensor:
        """``[B, max_q, H, D]`` outputs -> the real queries', packed ``[tokens, H, D]``."""
        if self.q_valid is None:
            return out.reshape(-1, *out.shape[2:])
        return out[self.q_valid]


@dataclass
class AttentionPlan:
    """One forward's groups and store slots (``valid``: None when every token stores), and
    the rotary factors of its positions per table, made at the first layer that reads one."""

    groups: list[GroupPlan]
    slots: torch.Tensor  # int64, the valid slots in token order
    valid: torch.Tensor | None
    _rope: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, RopeRows]] = field(
        default_factory=dict)

    def rope_rows(self, cos_sin: torch.Tensor, positions: torch.Tensor) -> RopeRows:
        """:func:`rope_rows` of ``positions`` in the table ``cos_sin`` (both held here, so
        that their ids stay theirs)."""
        key = (id(cos_sin), id(positions))
        if key not in self._rope:
            self._rope[key] = (cos_sin, positions, rope_rows(cos_sin, positions))
        return self._rope[key][2]


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``; itself where it is already (``Tensor.to`` costs a dispatch even so,
    and a decode step runs a few hundred of these)."""
    return t if t.dtype == dtype else t.to(dtype)


def like_sequences(q_lens: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Batch rows grouped by query count and by context length within a factor of two."""
    groups: dict[tuple[int, int], list[int]] = {}
    for row, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        groups.setdefault((q_len, max(seq_len - 1, 0).bit_length()), []).append(row)
    return list(groups.values())


def plan_attention(meta: AttentionMetadata, block_size: int) -> AttentionPlan:
    """The layout of ``meta``'s batch over a cache of ``block_size``-token blocks."""
    starts = meta.query_start_loc.tolist()
    q_lens = [end - start for start, end in zip(starts, starts[1:])]
    seq_lens = meta.seq_lens.tolist()
    groups = [_group(meta, rows, starts, q_lens, seq_lens, block_size)
              for rows in like_sequences(q_lens, seq_lens) if q_lens[rows[0]]]
    if len(groups) == 1 and groups[0].tokens.numel() == starts[-1]:
        groups[0].tokens = None  # one group holds every token, in order
    slot_mapping = meta.slot_mapping
    valid = slot_mapping >= 0
    if bool(valid.all()):
        return AttentionPlan(groups, slot_mapping.long(), None)
    return AttentionPlan(groups, slot_mapping[valid].long(), valid)


def _group(meta: AttentionMetadata, rows: list[int], starts: list[int], q_lens: list[int],
           seq_lens: list[int], block_size: int) -> GroupPlan:
    device = meta.seq_lens.device
    lens = [q_lens[r] for r in rows]
    max_q, max_kv = max(lens), max(seq_lens[r] for r in rows)
    tokens = list(itertools.chain.from_iterable(range(starts[r], starts[r + 1]) for r in rows))
    whole_rows = all(n == max_q for n in lens)
    span = (tokens[0], tokens[-1] + 1) if whole_rows and rows == list(
        range(rows[0], rows[-1] + 1)) else None
    q_lens_t = torch.tensor(lens, device=device)
    q_index = None
    if span is None:
        q_pos = torch.arange(max_q, device=device)
        row_starts = torch.tensor([starts[r] for r in rows], device=device)
        q_index = torch.where(q_pos[None, :] < q_lens_t[:, None],
                              row_starts[:, None] + q_pos[None, :], 0)
    q_valid = None if whole_rows else \
        torch.arange(max_q, device=device)[None, :] < q_lens_t[:, None]
    count = -(-max_kv // block_size)
    index = torch.tensor(rows, device=device)
    table = meta.block_tables[index, :count].long()
    first = int(table[0, 0]) if count else 0
    in_place = len(rows) == 1 and table[0].tolist() == list(range(first, first + count))
    return GroupPlan(q_lens_t, meta.seq_lens[index].long(), max_q, max_kv, span, q_index,
                     q_valid, torch.tensor(tokens, device=device), None if in_place else table,
                     first, min(seq_lens[r] for r in rows) == 0, block_size)
