"""What a prompt may be, and the context-length rule every request obeys (one place, so the
offline API, the engine and the server accept and refuse the same requests)."""
from __future__ import annotations

from typing import Any


def as_prompt_list(prompts: Any) -> list[Any]:
    """One prompt (a string or a list of token ids) or a sequence of prompts, as a list."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


class ContextLengthError(ValueError):
    """A request whose prompt plus ``max_tokens`` does not fit in ``max_model_len``;
    ``prompt_too_long``: the prompt alone leaves no room, so it is what to shorten."""

    def __init__(self, num_prompt_tokens: int, max_tokens: int, max_model_len: int):
        self.prompt_too_long = num_prompt_tokens >= max_model_len
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens (max_model_len), "
            f"but the request has {num_prompt_tokens} prompt tokens and asks for {max_tokens} "
            "more")


def check_context_length(num_prompt_tokens: int, max_tokens: int | None,
                         max_model_len: int) -> None:
    """Raise ContextLengthError unless the prompt and ``max_tokens`` (None: at least one
    token) fit in the context."""
    wanted = max_tokens or 1
    if num_prompt_tokens + wanted > max_model_len:
        raise ContextLengthError(num_prompt_tokens, wanted, max_model_len)


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The prompt's last ``keep`` token ids (``SamplingParams.truncate_prompt_tokens``: -1
    keeps ``max_model_len`` of them, None all); ``ids`` itself when nothing is cut."""
    if keep is None:
        return ids
    keep = max_model_len if keep == -1 else keep
    return ids[-keep:] if len(ids) > keep else ids
