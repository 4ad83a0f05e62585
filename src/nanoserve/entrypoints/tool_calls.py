"""Tool calls in a chat answer, in the Hermes format that Qwen2.5, Qwen3 and Hermes models emit:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` after any plain content. As vLLM's
``hermes`` parser, an answer whose calls do not all parse as JSON objects with a name is plain
content, and text after the first call is not content."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel

from nanoserve.entrypoints.reasoning import tag_start_at_end

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# Every closed call, and a last one cut short (by max_tokens or a stop) whose JSON is whole.
_CALL = re.compile(f"{re.escape(TOOL_CALL_START)}(.*?)(?:{re.escape(TOOL_CALL_END)}|$)",
                   re.DOTALL)


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's format)


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """``text``'s content (None when empty) and tool calls (none: ``text`` is all content)."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return text, []
    calls = []
    for body in _CALL.findall(text, start):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return text, []
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            return text, []
        calls.append(_call(call["name"], call.get("arguments", {})))
    return text[:start].strip() or None, calls


def _call(name: str, arguments: object) -> ToolCall:
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(
        name=name, arguments=arguments if isinstance(arguments, str) else json.dumps(arguments)))


@dataclass(frozen=True)
class ForcedToolCalls:
    """Reads an answer that a grammar held to calls (a forced ``tool_choice``): with ``name``,
    the answer is that function's arguments; without, a JSON array of ``{"name",
    "parameters"}`` objects. An answer cut short (max_tokens) parses to no calls."""

    name: str | None

    def parse(self, text: str) -> list[ToolCall]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return []
        if self.name is not None:
            return [_call(self.name, value)]
        return [_call(call["name"], call["parameters"]) for call in value]


class ToolCallStream:
    """One streamed choice's content up to the first ``<tool_call>`` (no part of a tag goes
    out); the rest is held, and at the end parsed into tool calls or flushed as content."""

    def __init__(self) -> None:
        self.shown = 0  # characters of the text passed on as content
        self.holding = False

    def content(self, text: str) -> str:
        """The content that the cumulative ``text`` adds to what went out."""
        if self.holding:
            return ""
        # Nothing shown can begin a tag: a possible beginning is held until it resolves.
        start = text.find(TOOL_CALL_START, self.shown)
        if start >= 0:
            self.holding = True
            end = start
        else:
            end = len(text) - tag_start_at_end(text, TOOL_CALL_START)
        new, self.shown = text[self.shown:end], max(self.shown, end)
        return new

    def finish(self, text: str) -> tuple[str, list[ToolCall]]:
        """At the answer's end (the whole ``text``): the content still to go out, and calls."""
        _, calls = parse_tool_calls(text)
        if calls:
            return "", calls
        rest = text[self.shown:]
        self.shown = len(text)
        return rest, []
