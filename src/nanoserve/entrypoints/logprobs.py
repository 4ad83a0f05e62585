"""Token logprobs in OpenAI's two shapes: chat's ``logprobs.content`` and completions' legacy
``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset`` lists.

The engine gives, for each generated token, a dict of the sampled token's logprob and the top
ones (raw model logprobs, before temperature and filters, as vLLM reports them). A token's
text is its id decoded alone.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from pydantic import BaseModel

from nanoserve.outputs import CompletionOutput

Decode = Callable[[list[int]], str]


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, float]], top: int,
                  decode: Decode) -> ChatLogprobs:
    """Chat's shape for ``token_ids`` with their engine logprobs, ``top`` alternatives each."""

    def entry(token: int, logprob: float) -> ChatTopLogprob:
        text = decode([token])
        return ChatTopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    return ChatLogprobs(content=[
        ChatTokenLogprob(**entry(token, lps[token]).model_dump(),
                         top_logprobs=[entry(t, lp) for t, lp in _top(lps, top)])
        for token, lps in zip(token_ids, logprobs, strict=True)])


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, float]],
                        top: int, decode: Decode, offset: int = 0) -> CompletionLogprobs:
    """Completions' shape; ``text_offset`` counts each token's text from ``offset`` on."""
    tokens = [decode([token]) for token in token_ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=[lps[t] for t, lps in zip(token_ids, logprobs, strict=True)],
        top_logprobs=[_by_text(lps, top, decode) for lps in logprobs], text_offset=offsets)


def _by_text(entry: dict[int, float], top: int, decode: Decode) -> dict[str, float]:
    """The legacy format keys alternatives by text; where two decode alike, the likelier stays."""
    alternatives: dict[str, float] = {}
    for token, logprob in _top(entry, top):
        alternatives.setdefault(decode([token]), logprob)
    return alternatives


def choice_logprobs(chat: bool, top: int | None, decode: Decode
                    ) -> Callable[[CompletionOutput], BaseModel | None]:
    """What a full response's choice carries as ``logprobs``: its tokens' in the endpoint's
    shape, or None when the request asked for none (``top`` None)."""

    def of(out: CompletionOutput) -> BaseModel | None:
        if top is None or out.logprobs is None:
            return None
        shape = chat_logprobs if chat else completion_logprobs
        return shape(out.token_ids, out.logprobs, top, decode)

    return of
