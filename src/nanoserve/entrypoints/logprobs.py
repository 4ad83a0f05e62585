"""Token logprobs in chat's and completions' (legacy lists) shapes, and vLLM's prompt_logprobs.

The engine gives, per token, a dict of its logprob and the top ones (the raw model's, as vLLM
reports them); a token's text is its id decoded alone. A prompt's first token has null
logprobs: nothing predicts it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from pydantic import BaseModel

from nanoserve.outputs import RequestOutput

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
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


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


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, float] | None],
                        top: int, decode: Decode, offset: int = 0) -> CompletionLogprobs:
    """Completions' shape, ``text_offset`` from ``offset`` on; a None entry has null logprobs."""
    tokens = [decode([token]) for token in token_ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    pairs = list(zip(token_ids, logprobs, strict=True))
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=[None if lps is None else lps[t] for t, lps in pairs],
        top_logprobs=[None if lps is None else _by_text(lps, top, decode) for _, lps in pairs],
        text_offset=offsets)


def prompt_logprobs_out(final: RequestOutput, top: int, decode: Decode) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs`` field: per prompt token its own logprob and the ``top``
    likeliest (the engine may hold more, for an echo that asked for more)."""
    out: PromptLogprobs = []
    for token, entry in zip(final.prompt_token_ids, final.prompt_logprobs or [], strict=True):
        if entry is None:
            out.append(None)
            continue
        kept = dict(_top(entry, top))
        kept[token] = entry[token]
        out.append({str(t): PromptLogprob(logprob=lp, decoded_token=decode([t]))
                    for t, lp in kept.items()})
    return out


def _by_text(entry: dict[int, float], top: int, decode: Decode) -> dict[str, float]:
    """The legacy format keys alternatives by text; where two decode alike, the likelier stays."""
    alternatives: dict[str, float] = {}
    for token, logprob in _top(entry, top):
        alternatives.setdefault(decode([token]), logprob)
    return alternatives


def choice_logprobs(final: RequestOutput, chat: bool, top: int | None, decode: Decode,
                    echo: bool = False) -> BaseModel | None:
    """A full response's choice's ``logprobs`` in the endpoint's shape (the prompt's first
    with ``echo``); None when the request asked for none (``top`` None)."""
    out = final.outputs[0]
    if top is None or out.logprobs is None:
        return None
    if chat:
        return chat_logprobs(out.token_ids, out.logprobs, top, decode)
    if echo:
        return completion_logprobs(final.prompt_token_ids + out.token_ids,
                                   final.prompt_logprobs + out.logprobs, top, decode)
    return completion_logprobs(out.token_ids, out.logprobs, top, decode)
