"""An embedding model's pooling of each prompt's final hidden states, chunk by chunk."""
from __future__ import annotations

import torch

from nanoserve.runner.inputs import SequenceChunk


class HiddenStatePooler:
    """Pools the hidden rows of embed requests' prompt chunks as steps pass: ``last`` keeps
    the prompt's last row, ``cls`` its first, ``mean`` their mean; a prompt prefilled in
    several chunks carries its partial pool (a row, or a float32 sum) between steps."""

    def __init__(self, pooling_type: str):
        self.pooling_type = pooling_type
        self.partial: dict[str, torch.Tensor] = {}

    def __call__(self, chunks: list[SequenceChunk], hidden: torch.Tensor
                 ) -> dict[str, list[float]]:
        """The pooled vector of each request whose prompt ends in this step (``hidden``: the
        step's rows in chunk order)."""
        done: dict[str, torch.Tensor] = {}
        offset = 0
        for chunk in chunks:
            rows = hidden[offset:offset + len(chunk.token_ids)].float()
            offset += len(chunk.token_ids)
            # A chunk from position 0 starts the prompt afresh (again, after a preemption).
            before = None if chunk.start == 0 else self.partial.pop(chunk.request_id, None)
            if self.pooling_type == "last":
                pooled = rows[-1]
            elif self.pooling_type == "cls":
                pooled = rows[0] if before is None else before
            else:
                pooled = rows.sum(0) if before is None else before + rows.sum(0)
            if chunk.sample:  # the prompt's last chunk
                if self.pooling_type == "mean":
                    pooled = pooled / (chunk.start + len(chunk.token_ids))
                done[chunk.request_id] = pooled
            else:
                self.partial[chunk.request_id] = pooled
        if not done:
            return {}
        vectors = torch.stack(list(done.values())).tolist()  # one copy to the host
        return dict(zip(done, vectors))

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.partial.pop(rid, None)
