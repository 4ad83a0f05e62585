"""Verification of proposed tokens by rejection sampling (Leviathan et al.; Chen et al.).

A verify step has logits at each sequence's last known token and at each of its proposals.
Row ``i`` is the target's distribution ``p`` for the token after the first ``i`` proposals,
processed as the sampler processes any row (penalties, temperature, top-k, top-p, min-p). A
proposal ``d`` (a point-mass draft, as n-gram lookup makes) is accepted with probability
``p(d)``; rejected, the row's token is drawn from ``p`` without ``d``, renormalised, i.e.
``normalize(max(p - q, 0))`` for ``q = onehot(d)``. Either way the row's token is distributed
exactly as ``p``. A greedy row accepts ``d`` when it is the argmax. The host takes each
sequence's tokens up to its first rejection, whose own token (or, with every proposal
accepted, the last row's sample) comes after the accepted ones.
"""
from __future__ import annotations

import torch

from nanoserve.runner.sampled_step import SampledStep
from nanoserve.runner.sampler import (SamplerOutput, _exponential_race, _with_logprobs,
                                      apply_penalties, filter_logits, mark_failed_rows)
from nanoserve.runner.inputs import StepOutput
from nanoserve.runner.sampling_tensors import SamplingTensors


def verify(logits: torch.Tensor, tensors: SamplingTensors, draft_ids: torch.Tensor,
           draft_rows: list[int]) -> tuple[SamplerOutput, torch.Tensor]:
    """Each row's token and whether it accepted its proposal. ``draft_ids`` [R] int64: the
    proposal each row scores, -1 for rows without one (a sequence's last row, or a sequence
    that proposed nothing); ``draft_rows``: the rows with one. Returns the rows' tokens (with
    logprobs as the sampler gives them) and [R] bool acceptances; no host-device sync. A
    seeded row without a proposal draws from its generator what the sampler would, so its
    tokens do not depend on what else is batched."""
    raw = logits.float()
    penalised = apply_penalties(raw, tensors)
    has_draft = draft_ids >= 0
    draft = draft_ids.clamp_min(0)
    greedy_ids = penalised.argmax(dim=-1)
    greedy_accept = has_draft & (greedy_ids == draft)
    if tensors.all_greedy:
        token_ids, accept = greedy_ids, greedy_accept
    else:
        probs = filter_logits(penalised, tensors).softmax(dim=-1)
        p_draft = probs.gather(1, draft[:, None])[:, 0]
        u = torch.rand(p_draft.shape, device=probs.device)
        with_draft = set(draft_rows)
        for row, generator in tensors.seeded_rows:
            if row in with_draft:
                u[row:row + 1].uniform_(generator=generator)
        accept = has_draft & (u < p_draft)
        # The residual max(p - onehot(d), 0) is p without d; the race needs no normalising.
        residual = probs.scatter(1, draft[:, None], torch.where(has_draft, 0.0, p_draft)[:, None])
        token_ids = torch.where(accept, draft, _exponential_race(residual, tensors.seeded_rows))
        if not tensors.all_random:
            greedy = tensors.temperature == 0.0
            token_ids = torch.where(greedy, greedy_ids, token_ids)
            accept = torch.where(greedy, greedy_accept, accept)
    out = _with_logprobs(raw, mark_failed_rows(logits, token_ids), tensors.max_logprobs)
    return out, accept


class VerifiedStep:
    """A launched verify step on its way to the host: each row's token and acceptance (in
    one pinned copy with the logprobs), grouped per sequence on ``result()``.
    ``num_drafts[i]``: how many proposals sampling chunk ``i`` scored (its rows: that + 1)."""

    def __init__(self, out: SamplerOutput, accept: torch.Tensor, num_drafts: list[int],
                 logprobs_wanted: list[int | None],
                 prompt_logprobs: dict[str, list[dict[int, float]]]):
        self.num_drafts = num_drafts
        rows = torch.stack([out.token_ids, accept.long()], dim=1)
        self.sampled = SampledStep(SamplerOutput(rows, out.logprobs, out.logprob_token_ids),
                                   logprobs_wanted, prompt_logprobs)

    def result(self) -> StepOutput:
        rows = self.sampled.result()
        row_logprobs = rows.logprobs
        token_ids, accepted, logprobs, accepted_logprobs = [], [], [], []
        at = 0
        for k in self.num_drafts:
            a = 0
            while a < k and rows.token_ids[at + a][1]:
                a += 1
            accepted.append([t for t, _ in rows.token_ids[at:at + a]])
            token_ids.append(rows.token_ids[at + a][0])
            if row_logprobs is not None:
                accepted_logprobs.append(row_logprobs[at:at + a])
                logprobs.append(row_logprobs[at + a])
            at += k + 1
        return StepOutput(token_ids, logprobs if row_logprobs is not None else None,
                          rows.prompt_logprobs, accepted,
                          accepted_logprobs if row_logprobs is not None else None)
