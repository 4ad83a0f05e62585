"""Logprobs of prompt tokens (``SamplingParams.prompt_logprobs``), from a prefill's hidden rows.

Position ``p`` of a prompt predicts its token ``p + 1``. The logits of a long prompt are
``vocab`` floats per token, so rows go through the LM head in slices. Reading the results waits
for the device: a step that carries such a chunk is not overlapped with the next.
"""
from __future__ import annotations

import torch

from nanoserve.runner.inputs import SequenceChunk

# Slices' float32 logits fit the headroom the runner leaves the sampler when sizing the cache.
ROWS_PER_SLICE = 256


def prompt_logprobs(model: torch.nn.Module, chunks: list[SequenceChunk], hidden: torch.Tensor
                    ) -> dict[str, list[dict[int, float]]]:
    """Per chunk with ``prompt_logprob_rows``, keyed by request id: for each of those first
    rows, the logprobs of the prompt token it predicts and of the top ones. ``hidden`` holds the
    step's rows in chunk order. Tensor-parallel workers (no sampling state) take part in the LM
    head's gather and return nothing."""
    if not any(chunk.prompt_logprob_rows for chunk in chunks):
        return {}
    rows, offset = [], 0
    for chunk in chunks:
        rows += range(offset, offset + chunk.prompt_logprob_rows)
        offset += len(chunk.token_ids)
    index = torch.tensor(rows, device=hidden.device)
    parts = [model.compute_logits(hidden[index[i:i + ROWS_PER_SLICE]])
             for i in range(0, len(rows), ROWS_PER_SLICE)]
    if parts[0] is None:
        return {}
    wanted = [c for c in chunks if c.prompt_logprob_rows]
    top = max(c.params.prompt_logprobs for c in wanted)
    targets = torch.tensor([t for c in wanted for t in
                            c.prompt_token_ids[c.start + 1:c.start + 1 + c.prompt_logprob_rows]],
                           device=hidden.device)
    values, ids = [], []
    for i, logits in enumerate(parts):
        logprobs = logits.float().log_softmax(dim=-1)
        slice_targets = targets[i * ROWS_PER_SLICE:i * ROWS_PER_SLICE + len(logprobs)]
        best = logprobs.topk(top, dim=-1)
        ids.append(torch.cat([slice_targets[:, None], best.indices], dim=1))
        values.append(torch.cat([logprobs.gather(1, slice_targets[:, None]), best.values], 1))
    all_values, all_ids = torch.cat(values).tolist(), torch.cat(ids).tolist()
    out, at = {}, 0
    for chunk in wanted:
        k = chunk.params.prompt_logprobs
        out[chunk.request_id] = [dict(zip(all_ids[r][:k + 1], all_values[r][:k + 1]))
                                 for r in range(at, at + chunk.prompt_logprob_rows)]
        at += chunk.prompt_logprob_rows
    return out
