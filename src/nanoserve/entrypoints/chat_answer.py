"""A chat answer's parts, whole or streamed: reasoning (``--reasoning-parser``), split off
first, then content and the tool calls parsed from it."""
from __future__ import annotations

from dataclasses import dataclass, field

from nanoserve.entrypoints.reasoning import ReasoningStream, split_reasoning
from nanoserve.entrypoints.tool_calls import (ForcedToolCalls, ToolCall, ToolCallStream,
                                              parse_tool_calls)


@dataclass
class AnswerParts:
    """What a chat answer (or the part of it since the last chunk) holds."""

    content: str | None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


def split_answer(text: str, tool_calls: bool | ForcedToolCalls,
                 reasoning_parser: str | None) -> AnswerParts:
    """A whole answer's parts; ``tool_calls``: parse the content for them (True), or read it
    as the calls a grammar forced."""
    reasoning, content = split_reasoning(text, reasoning_parser) if reasoning_parser \
        else (None, text)
    if reasoning is not None:
        content = content or None  # vLLM's: no content rather than an empty one
    if isinstance(tool_calls, ForcedToolCalls):
        calls = tool_calls.parse(content or "")
        return AnswerParts(None if calls else content, reasoning, calls)
    if tool_calls and content:
        before, calls = parse_tool_calls(content)
        if calls:
            return AnswerParts(before, reasoning, calls)
    return AnswerParts(content, reasoning)


class AnswerStream:
    """One streamed chat choice: each cumulative text in, the parts it adds out."""

    def __init__(self, tool_calls: bool | ForcedToolCalls, reasoning_parser: str | None):
        self.reasoning = ReasoningStream(reasoning_parser) if reasoning_parser else None
        # Forced calls: nothing goes out as content; the whole answer is parsed at the end.
        self.forced = tool_calls if isinstance(tool_calls, ForcedToolCalls) else None
        self.tool_calls = ToolCallStream() if tool_calls and not self.forced else None
        self.content_sent = ""  # without tool calls: the content passed on

    def advance(self, text: str, finished: bool) -> AnswerParts:
        """The reasoning and content that ``text`` adds; once ``finished``, the tool calls."""
        reasoning = ""
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(text, finished)
            text = content or ""
        if self.forced is not None:
            calls = self.forced.parse(text) if finished else []
            return AnswerParts(text if finished and not calls else "", reasoning, calls)
        if self.tool_calls is None:
            delta, self.content_sent = text[len(self.content_sent):], text
            return AnswerParts(delta, reasoning)
        delta = self.tool_calls.content(text)
        if not finished:
            return AnswerParts(delta, reasoning)
        rest, calls = self.tool_calls.finish(text)
        return AnswerParts(delta + rest, reasoning, calls)
