"""Speculative decoding's engine side: which sequences propose, how many tokens, and counts.

The scheduler asks for proposals for every chunk that reaches its request's last known token,
a prompt's last chunk included: its verify then samples the first token and checks proposals
made from the prompt alone in the same forward."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nanoserve.engine.request import Request
from nanoserve.engine.spec_ngram import NgramProposer
from nanoserve.spec_config import SpeculativeConfig

# After this many verify steps in a row that accepted nothing, a sequence stops proposing for
# a while, twice as long each further miss (up to MAX_PAUSE steps): a sequence whose text does
# not repeat costs at most a few wasted verifies, then runs as plain decodes.
MISSES_BEFORE_PAUSE = 2
MAX_PAUSE = 64


@dataclass
class SpecState:
    """A sequence's adaptive proposal length and its pause after repeated misses."""

    k: int
    misses: int = 0
    pause: int = 0


@dataclass
class SpecStats:
    """vLLM's spec-decode counters: verify steps with proposals, tokens proposed, accepted,
    and accepted per position (``accepted_per_pos[i]``: proposals ``i`` accepted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class SpecDecoder:
    """Proposes tokens for running sequences before each schedule, adapts each sequence's
    proposal length to what it had accepted, and counts. A request is run without speculation
    (a plain one-token decode) while its sampling reads its token history (penalties), it is
    held to a grammar, or it has not reached ``min_tokens`` (its next tokens' distributions
    would depend on the proposals themselves), or it asked for prompt logprobs."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.check_supported(config)
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.stats = SpecStats(accepted_per_pos=[0] * self.k)

    @staticmethod
    def check_supported(config: SpeculativeConfig | None) -> None:
        """Refuse, before any model loads, a method this engine does not run."""
        if config is not None and config.method != "ngram":
            raise ValueError(f"speculative_config.method {config.method!r} is not implemented "
                             "yet; use 'ngram'")

    def eligible(self, req: Request) -> bool:
        params = req.params
        return not (params.needs_token_history or params.structured_outputs is not None
                    or params.prompt_logprobs is not None
                    or req.num_sampled_tokens < params.min_tokens)

    def propose(self, req: Request) -> list[int]:
        """Tokens for ``req``'s next step to verify after its last known token (none at all
        while it is not eligible, or pauses after misses)."""
        if not self.eligible(req):
            return []
        state = req.spec_state
        if state is None:
            state = req.spec_state = SpecState(self.k)
        if state.pause:
            state.pause -= 1
            return []
        # Never propose past max_tokens or the model's length: the verify samples after
        # the last proposal too.
        room = min(req.max_tokens - req.num_sampled_tokens,
                   self.max_model_len - req.num_tokens) - 1
        k = min(state.k, room)
        if k < 1:
            return []
        return self.proposer.propose(np.asarray(req.token_ids, dtype=np.int64), k)

    def record(self, req: Request, num_proposed: int, num_accepted: int) -> None:
        """Count a verify step's outcome and adapt the request's proposal length."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_proposed
        stats.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            stats.accepted_per_pos[i] += 1
        state = req.spec_state
        if num_accepted == num_proposed:
            state.k, state.misses = min(self.k, state.k + 1), 0
        elif num_accepted:
            state.k, state.misses = num_accepted + 1, 0
        else:
            state.k, state.misses = max(1, state.k // 2), state.misses + 1
            if state.misses >= MISSES_BEFORE_PAUSE:
                state.pause = min(MAX_PAUSE, 2 ** (state.misses - MISSES_BEFORE_PAUSE))
