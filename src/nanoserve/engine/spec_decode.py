"""Speculative decoding's engine side: which sequences propose, how many tokens, and counts.

The scheduler asks for proposals for every chunk that reaches its request's last known token,
a prompt's last chunk included (n-gram lookup): its verify then samples the first token and
checks proposals made from the prompt alone in the same forward. A draft model proposes for
decodes only, its k steps batched before the schedule."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nanoserve.engine.request import Request
from nanoserve.engine.spec_draft import DraftProposer
from nanoserve.engine.spec_gate import SpecGate
from nanoserve.engine.spec_ngram import NgramProposer
from nanoserve.spec_config import SpeculativeConfig

# After this many verify steps in a row that accepted nothing, a sequence stops proposing for
# a while, twice as long each further miss (up to MAX_PAUSE steps): a sequence whose text does
# not repeat costs at most a few wasted verifies, then runs as plain decodes.
MISSES_BEFORE_PAUSE = 2
MAX_PAUSE = 64


@dataclass
class SpecState:
    """A sequence's adaptive proposal length and its pause after repeated misses; with a
    draft model, its place in the draft's cache and the proposals made for the next step."""

    k: int
    misses: int = 0
    pause: int = 0
    draft: Any = None  # spec_draft.DraftState
    proposals: list[int] = field(default_factory=list)
    # The known token ids as int64 (the first num_history of it), for n-gram lookup: only
    # the tokens new since the last step are converted, not the whole history each step.
    history: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    num_history: int = 0

    def known_tokens(self, token_ids: list[int]) -> np.ndarray:
        """``token_ids`` (which only ever grows) as int64, from the kept copy."""
        n = len(token_ids)
        if n > len(self.history):  # doubling: appends cost amortised O(1)
            grown = np.empty(max(n, 2 * len(self.history)), dtype=np.int64)
            grown[:self.num_history] = self.history[:self.num_history]
            self.history = grown
        if n > self.num_history:
            self.history[self.num_history:n] = token_ids[self.num_history:]
            self.num_history = n
        return self.history[:n]


@dataclass
class SpecStats:
    """vLLM's spec-decode counters: verify steps with proposals, tokens proposed, accepted,
    and accepted per position (``accepted_per_pos[i]``: proposals ``i`` accepted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class SpecDecoder:
    """Proposes tokens for the scheduler (n-gram lookup when it asks; a draft model's, run
    for the whole batch by ``prepare`` before each schedule), adapts each sequence's
    proposal length to what it had accepted, and counts. A request is run without speculation
    (a plain one-token decode) while its sampling reads its token history (penalties), it is
    held to a grammar, or it has not reached ``min_tokens`` (its next tokens' distributions
    would depend on the proposals themselves), or it asked for prompt logprobs."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 draft: DraftProposer | None = None):
        if (config.method == "draft_model") != (draft is not None):
            raise ValueError("speculative_config.method 'draft_model' needs its draft "
                             "executor (LLMEngine.from_config makes it)")
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.ngram = None if draft is not None else NgramProposer(config.prompt_lookup_min,
                                                                  config.prompt_lookup_max)
        self.draft = draft
        self.stats = SpecStats(accepted_per_pos=[0] * self.k)
        self.gate = SpecGate() if config.disable_when_slower else None
        self.active = True  # this step proposes (the gate's choice)

    def begin_step(self, num_seqs: int) -> bool:
        """Whether the step about to be scheduled over ``num_seqs`` running sequences
        speculates."""
        self.active = self.gate is None or self.gate.begin(num_seqs)
        return self.active

    def end_step(self, num_output_tokens: int, computed_prompt: bool) -> None:
        if self.gate is not None:
            self.gate.end(num_output_tokens, computed_prompt)

    def idle(self) -> None:
        """No requests left: the wait for the next one is no step's time."""
        if self.gate is not None:
            self.gate.idle()

    def eligible(self, req: Request) -> bool:
        params = req.params
        return not (params.needs_token_history or params.structured_outputs is not None
                    or params.prompt_logprobs is not None
                    or req.num_sampled_tokens < params.min_tokens)

    def _budget(self, req: Request) -> int:
        """How many tokens ``req`` proposes for its next step: 0 while it is not eligible or
        pauses after misses, and never past max_tokens or the model's length (the verify
        samples after the last proposal too)."""
        if not self.eligible(req):
            return 0
        state = req.spec_state
        if state is None:
            state = req.spec_state = SpecState(self.k)
        if state.pause:
            state.pause -= 1
            return 0
        room = min(req.max_tokens - req.num_sampled_tokens,
                   self.max_model_len - req.num_tokens) - 1
        return max(0, min(state.k, room))

    def prepare(self, running: list[Request]) -> None:
        """With a draft model: run it for the running sequences that decode next step, in
        one batch, before the scheduler asks for their proposals."""
        if self.draft is None or not self.active:
            return
        wanted = []
        for req in running:
            if req.spec_state is not None:
                req.spec_state.proposals = []
            if req.num_pending_tokens or req.num_computed_tokens != req.num_tokens - 1:
                continue
            k = self._budget(req)
            if k:
                wanted.append((req, k))
        proposals = self.draft.propose(wanted)
        for req, _ in wanted:
            req.spec_state.proposals = proposals.get(req.request_id, [])

    def propose(self, req: Request) -> list[int]:
        """Tokens for ``req``'s next step to verify after its last known token."""
        if not self.active:
            return []
        if self.draft is not None:  # made by prepare(), for this step only
            if req.spec_state is None:
                return []
            proposals, req.spec_state.proposals = req.spec_state.proposals, []
            return proposals
        k = self._budget(req)
        if k < 1:
            return []
        return self.ngram.propose(req.spec_state.known_tokens(req.token_ids), k)

    def release(self, req: Request) -> None:
        """A request finished: its draft cache blocks go back."""
        if self.draft is not None:
            self.draft.release(req)

    def record(self, req: Request, num_proposed: int, num_accepted: int, num_valid: int) -> None:
        """Count a verify step's outcome and adapt the request's proposal length;
        ``num_valid``: the request's tokens before the one sampled after the accepted."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_proposed
        stats.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            stats.accepted_per_pos[i] += 1
        state = req.spec_state
        if self.draft is not None:
            self.draft.rollback(req, num_valid)
        if num_accepted == num_proposed:
            state.k, state.misses = min(self.k, state.k + 1), 0
        elif num_accepted:
            state.k, state.misses = num_accepted + 1, 0
        else:
            state.k, state.misses = max(1, state.k // 2), state.misses + 1
            if state.misses >= MISSES_BEFORE_PAUSE:
                state.pause = min(MAX_PAUSE, 2 ** (state.misses - MISSES_BEFORE_PAUSE))


def draft_model_assets(config: Any, target: Any) -> tuple[Any, Any] | None:
    """The draft model's path and ModelConfig when ``config`` asks for one (None otherwise),
    refused unless it shares the target's vocabulary."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    from nanoserve.config import ModelConfig, resolve_model_path
    from nanoserve.models.asset_cache import cached_model_assets

    path = resolve_model_path(spec.model)
    # A GGUF draft's config and tokenizer from the asset cache, not parsed again.
    hf_config, _, extra_eos = cached_model_assets(
        path, require_weights=config.load_format != "dummy")
    draft = ModelConfig.from_hf(hf_config, extra_eos)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model has a vocabulary of {draft.vocab_size} "
                         f"tokens, the target {target.vocab_size}: they must share a tokenizer")
    return path, draft
