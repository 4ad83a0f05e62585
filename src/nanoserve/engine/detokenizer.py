"""Incremental detokenization and stop-string handling for one request."""
from __future__ import annotations

from typing import Any

# Prompt tokens decoded along with the first output tokens, so word-boundary spaces come out
# the way a full decode would render them.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, never splitting a multi-byte character:
    decodes a short sliding window and emits what lies past the text of the tokens already
    read; a window ending in U+FFFD waits for the next token."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full_text[len(prefix_text):]
        return ""

    def decode_all(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` in one decode, as pushing them one by one would give it."""
        context = self._decode(self.ids[self.prefix_offset:])
        return self._decode(self.ids[self.prefix_offset:] + token_ids)[len(context):]

    def flush(self) -> str:
        """The text still held back at the end (an incomplete character as U+FFFD), so the
        final text equals ``tokenizer.decode``."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full_text[len(prefix_text):]


def find_stop(text: str, num_new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the newly added text: (start index, stop)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        begin = max(0, len(text) - num_new_chars - len(stop) + 1)
        idx = text.find(stop, begin)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best
