"""Prompt-lookup (n-gram) proposals for speculative decoding, found on the host with numpy."""
from __future__ import annotations

import numpy as np


class NgramProposer:
    """Proposes the tokens that followed the latest earlier occurrence of the sequence's
    longest matching suffix n-gram (``min_n`` to ``max_n`` tokens); no match, no proposal.

    Candidates are the earlier positions holding the last token; their matches are extended
    backwards one offset at a time over all candidates at once, so a step costs ``max_n``
    vectorised comparisons whatever the history's length.
    """

    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: np.ndarray, k: int) -> list[int]:
        """Up to ``k`` proposed next tokens for the sequence ``token_ids`` (int64, 1-D)."""
        n = len(token_ids)
        if k < 1 or n < self.min_n + 1:
            return []
        # Candidate ends c < n - 1 whose token equals the last one.
        cand = np.flatnonzero(token_ids[:n - 1] == token_ids[n - 1])
        if not len(cand):
            return []
        length = np.ones(len(cand), dtype=np.int64)  # matched suffix length per candidate
        alive = np.ones(len(cand), dtype=bool)
        for j in range(1, self.max_n):
            alive &= cand >= j
            if not alive.any():
                break
            # Clamped index: dead candidates compare garbage, and stay dead.
            alive &= token_ids[np.maximum(cand - j, 0)] == token_ids[n - 1 - j]
            length += alive
        best = length.max()
        if best < self.min_n:
            return []
        end = cand[np.flatnonzero(length == best)[-1]]  # the latest of the longest
        return token_ids[end + 1:end + 1 + k].tolist()
