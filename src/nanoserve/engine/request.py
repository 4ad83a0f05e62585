"""A request's life in the engine: its tokens, progress, blocks and how it finished."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from nanoserve.sampling_params import SamplingParams


def sample_request_ids(request_id: str, n: int) -> list[str]:
    """The engine ids of a request's ``n`` samples: its own id when it has one sample."""
    return [request_id] if n == 1 else [f"{request_id}-{k}" for k in range(n)]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"  # a failure in the request's own work; stop_reason holds the message


@dataclass
class Request:
    """One generation request: prompt + output tokens and how far the KV cache covers them.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache (preemption resets it to 0
    and the request recomputes them). ``num_pending_tokens`` counts tokens sampled by steps
    still on the device: in ``num_tokens``, not yet in ``token_ids`` (known tokens only).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    eos_token_ids: frozenset[int]
    arrival_time: float = field(default_factory=time.time)
    stream: bool = True  # report progress every step; False: only the final output
    # A sibling sample that computes the shared prompt first: this one waits to be admitted
    # until it has, then takes the prompt's full blocks from the prefix cache.
    prefix_leader: Request | None = field(default=None, repr=False, compare=False)
    token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_pending_tokens: int = 0
    num_cached_tokens: int = 0
    # One block table per cache group (attention/cache_spec.py), all as long.
    block_tables: list[list[int]] = field(default_factory=list)
    num_registered_blocks: int = 0  # leading blocks already entered in the prefix cache
    num_slid_blocks: int = 0  # sliding groups' leading blocks freed: the window is past them
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    output_text: str = ""
    logprobs: list[dict[int, float]] | None = None
    # One entry per prompt token, the first None (nothing predicts it), when params ask.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_preemptions: int = 0
    spec_state: Any = None  # speculative decoding's state for it (engine/spec_decode.py)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    def prompt_logprob_rows(self, start: int, num_tokens: int) -> int:
        """How many of a chunk's positions, from ``start`` on, predict a prompt token."""
        return max(0, min(start + num_tokens, self.num_prompt_tokens - 1) - start)

    def add_prompt_logprobs(self, first: int, entries: list[dict[int, float]]) -> None:
        """Logprobs of the prompt tokens from ``first`` on, less those already known (a
        preempted request computes its prompt again)."""
        assert self.prompt_logprobs is not None and first <= len(self.prompt_logprobs)
        self.prompt_logprobs.extend(entries[len(self.prompt_logprobs) - first:])

    @property
    def block_table(self) -> list[int]:
        """The first cache group's block table (the only one, unless layers slide apart)."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        """Output tokens known on the host (pending ones not included)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_sampled_tokens(self) -> int:
        """Output tokens sampled so far, known or still on the device."""
        return self.num_output_tokens + self.num_pending_tokens

    @property
    def detokenizes_each_token(self) -> bool:
        """Text is built token by token when it is streamed or stop strings must be watched."""
        return self.stream or bool(self.params.stop_strings)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.num_pending_tokens = 0  # tokens sampled past the end are dropped
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finished_time = time.time()
