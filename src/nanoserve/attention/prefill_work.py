"""The prefill attention kernel's programs, listed on the host in numpy (no Triton on CPU)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def prefill_work(query_lens: Sequence[int], seq_lens: Sequence[int], tile: int) -> np.ndarray:
    """The (sequence, query tile) pairs of a prefill launch with ``tile`` tokens a tile, as
    ``[2, N]`` int32 (row 0 the sequences, row 1 the tiles), ordered by the keys each pair reads,
    most first; ties keep batch order. Sequence ``i`` has ``query_lens[i]`` new tokens at the
    end of its ``seq_lens[i]`` positions."""
    q_lens = np.asarray(query_lens, dtype=np.int64)
    s_lens = np.asarray(seq_lens, dtype=np.int64)
    tiles = -(-q_lens // tile)
    seq = np.repeat(np.arange(len(q_lens)), tiles)
    index = np.arange(len(seq)) - np.repeat(np.cumsum(tiles) - tiles, tiles)
    # Causal: a tile reads the keys up to its last token, or to the sequence's end.
    keys = np.minimum(s_lens[seq], (s_lens - q_lens)[seq] + (index + 1) * tile)
    order = np.argsort(-keys, kind="stable")
    return np.stack([seq[order], index[order]]).astype(np.int32)
