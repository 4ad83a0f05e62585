"""Per-step attention metadata: the one object every attention layer reads during a forward."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """A forward pass's batch: every sequence's new tokens back to back (``T`` in all), sequence
    ``i``'s after its cached ones, its keys read through ``block_tables[i]``. Where the cache
    has several groups (attention/cache_spec.py), ``group(g)`` is the view of group ``g``'s
    layers: its block tables and slots; the rest is shared."""

    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative new-token counts
    seq_lens: torch.Tensor  # [B] int32, context length after this step (cached + new)
    slot_mapping: torch.Tensor  # [T] int64, cache slot (block * block_size + offset) per token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    # [B] int32 in decode-only steps: decode kernels' sequence order (None: batch order).
    seq_order: torch.Tensor | None = None
    # [2, N] int32 in other steps on the GPU: the prefill kernel's programs (prefill_work.py).
    prefill_work: torch.Tensor | None = None
    # Decode-only rows that are consecutive tokens of one sequence (a verify step's): a row's
    # keys include the rows' before it, so each row's K/V is stored before any row attends.
    rows_share_sequences: bool = False
    groups: tuple[AttentionMetadata, ...] = field(default=(), repr=False)

    def with_groups(self, block_tables: Sequence[torch.Tensor],
                    slot_mappings: Sequence[torch.Tensor]) -> AttentionMetadata:
        """This batch with a view per cache group (group 0's tables and slots its own)."""
        groups = tuple(dataclasses.replace(self, block_tables=tables, slot_mapping=slots)
                       for tables, slots in zip(block_tables, slot_mappings))
        return dataclasses.replace(groups[0], groups=groups)

    def group(self, index: int) -> AttentionMetadata:
        """The metadata that cache group ``index``'s layers read."""
        return self.groups[index] if self.groups else self

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


_current: AttentionMetadata | None = None


def get_attention_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention metadata is only set inside a model forward "
                           "(use attention_metadata(...) around the call)")
    return _current


@contextmanager
def attention_metadata(meta: AttentionMetadata | None) -> Iterator[None]:
    """Make ``meta`` visible to every attention layer for the duration of one forward."""
    global _current
    previous, _current = _current, meta
    try:
        yield
    finally:
        _current = previous
