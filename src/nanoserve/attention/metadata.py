"""Per-step attention metadata: the one object every attention layer reads during a forward."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from collections.abc import Iterator

import torch


@dataclass
class AttentionMetadata:
    """Describes a flattened batch of sequences for one forward pass.

    The batch packs every scheduled sequence's new tokens back to back (``T`` tokens in all).
    Sequence ``i`` contributes ``query_start_loc[i+1] - query_start_loc[i]`` new tokens whose
    keys are appended after ``seq_lens[i] - q_len_i`` tokens already in the paged cache; its
    keys are read through ``block_tables[i]`` (padded with 0 past the sequence's last block).
    """

    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative new-token counts
    seq_lens: torch.Tensor  # [B] int32, context length after this step (cached + new)
    slot_mapping: torch.Tensor  # [T] int64, cache slot (block * block_size + offset) per token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    # [B] int32 in decode-only steps: the sequences, longest context first. Decode kernels
    # hand sequences to programs in this order (see kernels/decode_attention.py); None keeps
    # batch order.
    seq_order: torch.Tensor | None = None
    # [2, N] int32 in other steps on the GPU: the prefill kernel's programs, (sequence, query
    # tile) pairs with the most keys first (attention/prefill_work.py).
    prefill_work: torch.Tensor | None = None

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
