"""A chat answer's ``<think>`` reasoning split from its content, as vLLM's --reasoning-parser.

``qwen3``: an answer reasons only when it opens with ``<think>`` (Qwen3 with thinking off
answers directly). ``deepseek_r1``: from its start, as DeepSeek-R1's template opens the block
in the prompt. An answer cut short while thinking has reasoning and no content.

Standard library only: the CLI reads REASONING_PARSERS where the server's packages may be
missing.
"""
from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


def split_reasoning(text: str, parser: str) -> tuple[str | None, str | None]:
    """``text``'s reasoning (None when it has none) and content (None while still thinking)."""
    opens = text.startswith(THINK_START)
    if parser == "qwen3" and not opens:
        return None, text
    reasoning, end, content = text[len(THINK_START) if opens else 0:].partition(THINK_END)
    return reasoning, content if end else None


class ReasoningStream:
    """One streamed choice's reasoning, passed on as it grows; the tags are never passed on."""

    def __init__(self, parser: str):
        self.parser = parser
        self.sent = 0  # characters of the reasoning passed on

    def split(self, text: str, finished: bool) -> tuple[str, str | None]:
        """The reasoning the cumulative ``text`` adds, and the content so far (None: thinking)."""
        if not finished and THINK_START.startswith(text):
            return "", None  # the answer may be opening its thinking block
        reasoning, content = split_reasoning(text, self.parser)
        if reasoning is None:
            return "", content
        if content is None and not finished:
            reasoning = reasoning[:len(reasoning) - tag_start_at_end(reasoning, THINK_END)]
        new, self.sent = reasoning[self.sent:], max(self.sent, len(reasoning))
        return new, content


def tag_start_at_end(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (not all of it): what a stream
    must hold back until the next text tells whether the tag follows."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
