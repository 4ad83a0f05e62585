"""What the engine hands back to callers: one RequestOutput per request."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sequence of a request: cumulative text and token ids so far."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None: running
    # The stop string or stop token id that ended it; for "error", the error's message.
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    """State of one request after an engine step (or at its end), vLLM's shape."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # With SamplingParams.prompt_logprobs: per prompt token (the first None), its own and the
    # top logprobs.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # An embedding model's: the prompt's pooled final hidden state (not yet normalised).
    embedding: list[float] | None = None
