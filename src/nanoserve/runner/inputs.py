"""What the engine asks the model runner to compute in one step (plain Python, no tensors)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from nanoserve.sampling_params import SamplingParams

# Stands for a token that the previous step sampled and the host has not seen yet: the runner
# feeds that step's sample for the same request straight from device memory.
PENDING_TOKEN = -1
# Reported instead of a sampled token for a row whose logits are not finite (NaN, infinity):
# the engine fails that request alone.
FAILED_ROW = -2


@dataclass
class SequenceChunk:
    """New tokens of one sequence for this step, with where they go in its paged cache."""

    request_id: str
    token_ids: list[int]
    start: int  # position of token_ids[0] in the sequence
    block_table: list[int]  # its first cache group's
    sample: bool  # the chunk ends the sequence's known tokens: sample the next one
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: list[int]  # not to be sampled now (EOS and stops before min_tokens)
    # The chunk's first positions whose next token is a prompt token whose logprobs were asked
    # for (SamplingParams.prompt_logprobs): each predicts the token after it.
    prompt_logprob_rows: int = 0
    # The last ones of token_ids are proposals to verify: the step samples at each of them
    # and at the token before them (speculative decoding).
    num_draft_tokens: int = 0
    # With several cache groups, block_table is the first's and these the others' (as long).
    more_tables: list[list[int]] = field(default_factory=list)


@dataclass
class StepInput:
    """A step's chunks; ``grammar_rows`` are the sampling rows (indices among the chunks that
    sample) under a grammar, whose next-token bitmask ([rows, ceil(V / 32)] int32) comes with
    the step, or, when None, later through ``DeferredSample.flush``."""

    chunks: list[SequenceChunk]
    finished_request_ids: list[str] = field(default_factory=list)
    grammar_rows: list[int] = field(default_factory=list)
    token_bitmask: np.ndarray | None = None


@dataclass
class StepOutput:
    """Sampled token per sampling chunk, in order; optional logprobs alongside; per request
    whose chunk had ``prompt_logprob_rows``, the logprobs of the prompt tokens they predict.
    In a step that verified proposals, ``accepted_token_ids[i]`` are chunk ``i``'s accepted
    ones (``accepted_logprobs[i]`` theirs), which come before ``token_ids[i]``."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None] | None = None
    prompt_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    accepted_token_ids: list[list[int]] | None = None
    accepted_logprobs: list[list[dict[int, float]] | None] | None = None
    # An embedding model's (task "embed"): per request whose prompt ended, its pooled state.
    embeddings: dict[str, list[float]] = field(default_factory=dict)


class InFlightStep(Protocol):
    """A launched step whose tokens are on their way to the host."""

    def result(self) -> StepOutput:
        """Wait for the step and return its sampled tokens."""


class DeferredSample:
    """A launched step whose sampling waits for its grammar rows' bitmask, which the host
    fills while the forward runs: ``flush`` (at the latest before the next step is launched,
    whose forward reads these tokens) queues the sampling with the bitmask
    ``bitmask_source`` gives."""

    def __init__(self, sample: Callable[[np.ndarray], InFlightStep]):
        self.sample = sample
        self.sampled: InFlightStep | None = None
        self.bitmask_source: Callable[[], np.ndarray] | None = None

    def flush(self) -> None:
        if self.sampled is None:
            assert self.bitmask_source is not None, "a deferred sample needs its bitmask"
            self.sampled = self.sample(self.bitmask_source())

    def result(self) -> StepOutput:
        self.flush()
        return self.sampled.result()


@dataclass
class CompletedStep:
    """A step whose output is already on the host."""

    output: StepOutput

    def result(self) -> StepOutput:
        return self.output
