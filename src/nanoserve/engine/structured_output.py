"""Structured output: grammars compiled by xgrammar, one matcher per constrained request, and
the next-token bitmask of every constrained row of a step (a 1 bit: the token may come next).

Compilation runs on a thread pool and is cached by the constraint's text, so callers that
must not block (the server) wait for it beside the engine. A matcher advances on each token
the request accepts; its grammar only lets an end-of-sequence token through where the output
may end, so a request ends (finish reason ``stop``) exactly when its grammar is complete.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from nanoserve.sampling_params import StructuredOutputsParams

CACHE_SIZE = 512  # compiled grammars kept (least recently used goes first)
# Whitespace allowed between JSON tokens: plenty for any layout, and a sampled model cannot
# spend its whole budget on blank lines (unbounded, small models at temperature 1 do).
JSON_MAX_WHITESPACE = 16
FEW_ROWS = 16  # bitmasks of fewer rows are filled one by one, of more on xgrammar's threads
# JSON-schema keywords that xgrammar accepts but does not enforce: refused, never ignored.
UNENFORCED_KEYWORDS = frozenset({
    "uniqueItems", "not", "contains", "minContains", "maxContains", "dependentRequired",
    "dependentSchemas", "if", "then", "else", "unevaluatedProperties", "unevaluatedItems"})
_NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "propertyNames", "additionalItems")


class GrammarCompiler:
    """Compiles constraints into xgrammar grammars for one tokenizer, off the caller's thread,
    keeping the latest ``CACHE_SIZE``. Errors are ValueErrors naming the constraint's field."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 num_threads: int = 2):
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids)
        self.xgr, self.tokenizer = xgr, tokenizer
        self.compiler = xgr.GrammarCompiler(info, max_threads=num_threads, cache_enabled=False)
        self.vocab_size = vocab_size
        self.pool = ThreadPoolExecutor(num_threads, thread_name_prefix="nanoserve-grammar")
        self.cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self.lock = threading.Lock()

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """The compiled grammar of ``spec``, as a future (done at once when cached)."""
        key = spec.key()
        with self.lock:
            future = self.cache.get(key)
            if future is None:
                future = self.cache[key] = self.pool.submit(self._compile, *key)
            self.cache.move_to_end(key)
            while len(self.cache) > CACHE_SIZE:
                self.cache.popitem(last=False)
        return future

    def compile(self, spec: StructuredOutputsParams) -> Any:
        return self.submit(spec).result()

    def _compile(self, kind: str, text: str, compact: bool) -> Any:
        if kind == "choice":
            self._check_writable(json.loads(text))
        grammar = self._compile_text(kind, text, compact)
        if not self._can_start(grammar):
            raise ValueError(f"structured_outputs.{kind} cannot be written with this model's "
                             "vocabulary: no token may come first")
        return grammar

    def _can_start(self, grammar: Any) -> bool:
        """Whether some token (end-of-sequence included) may come first: a text whose bytes
        no token holds (a vocabulary without byte fallback) would leave none to sample."""
        bits = np.zeros((1, -(-self.vocab_size // 32)), dtype=np.int32)
        self.xgr.GrammarMatcher(grammar).fill_next_token_bitmask(bits, 0)
        return bool(bits.any())

    def _check_writable(self, choices: list[str]) -> None:
        """A ValueError naming the first choice that no token sequence spells (its text does
        not survive encoding): its grammar would lead the sampler to a dead end."""
        for i, choice in enumerate(choices):
            if self.tokenizer.decode(self.tokenizer.encode(choice, add_special_tokens=False)) \
                    != choice:
                raise ValueError(f"structured_outputs.choice[{i}] cannot be written with this "
                                 "model's vocabulary")

    def _compile_text(self, kind: str, text: str, compact: bool) -> Any:
        whitespace = {"any_whitespace": not compact,
                      "max_whitespace_cnt": None if compact else JSON_MAX_WHITESPACE}
        try:
            if kind == "json":
                check_enforceable(json.loads(text))
                return self.compiler.compile_json_schema(text, **whitespace)
            if kind == "json_object":  # any object: no property is "additional" here
                return self.compiler.compile_json_schema('{"type": "object"}', strict_mode=False,
                                                         **whitespace)
            if kind == "regex":
                return self.compiler.compile_regex(text)
            if kind == "choice":
                choices = json.loads(text)
                return self.compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
            return self.compiler.compile_grammar(text)
        except (RuntimeError, ValueError) as exc:  # xgrammar reports bad input as RuntimeError
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"structured_outputs.{kind} cannot be compiled: "
                             f"{reason.split(': ', 1)[-1]}") from None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def check_enforceable(schema: Any, path: str = "#") -> None:
    """A ValueError if ``schema`` uses a keyword the grammar would silently not enforce."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__} at {path}")
    for word in UNENFORCED_KEYWORDS & schema.keys():
        if not (word == "uniqueItems" and schema[word] is False):
            raise ValueError(f"the keyword {word!r} at {path} is not supported")
    for group in _NAMED_SCHEMAS:
        for name, sub in (schema.get(group) or {}).items():
            check_enforceable(sub, f"{path}/{group}/{name}")
    for group in _SCHEMA_LISTS:
        for i, sub in enumerate(schema.get(group) or []):
            check_enforceable(sub, f"{path}/{group}/{i}")
    for group in _SCHEMA_VALUES:
        if isinstance(schema.get(group), dict):
            check_enforceable(schema[group], f"{path}/{group}")


class StructuredOutputs:
    """Every constrained request's matcher: advanced on the tokens the request accepts, and
    asked for the next-token bitmask of the rows a step samples. A step's bitmask may be
    filled on a worker thread (``start_bitmask``, xgrammar releasing the GIL) while the engine
    turns the previous step's tokens into outputs; nothing else touches the matchers until
    ``wait_bitmask``, except to look up whether the last ``accept`` terminated them."""

    def __init__(self, compiler: GrammarCompiler):
        import xgrammar as xgr

        self.xgr = xgr
        self.compiler = compiler
        self.matchers: dict[str, Any] = {}
        self.words = -(-compiler.vocab_size // 32)
        self.batch = xgr.BatchGrammarMatcher()  # half the hardware threads: more ran slower
        self.buffer = np.empty((0, self.words), dtype=np.int32)  # reused: no 4 MB fill a step
        self.terminated: set[str] = set()  # the requests whose grammar the last accept ended
        self.filler = ThreadPoolExecutor(1, thread_name_prefix="nanoserve-bitmask")
        self.pending: Future | None = None

    def add(self, request_id: str, spec: StructuredOutputsParams) -> None:
        """Start ``request_id``'s matcher; a constraint that does not compile raises."""
        self.matchers[request_id] = self.xgr.GrammarMatcher(self.compiler.compile(spec))

    def remove(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def accept(self, tokens: dict[str, int]) -> dict[str, bool]:
        """Advance the matchers of ``tokens``' requests by one token each, in one call; per
        request, False when its grammar does not allow the token."""
        self._settle()
        ids = [rid for rid in tokens if rid in self.matchers]
        ok = self.xgr.BatchGrammarMatcher.batch_accept_token(
            [self.matchers[rid] for rid in ids], [tokens[rid] for rid in ids])
        self.terminated = {rid for rid, good in zip(ids, ok)
                           if good and self.matchers[rid].is_terminated()}
        return dict(zip(ids, ok))

    def allows_nothing(self, request_id: str) -> bool:
        """Whether ``request_id``'s grammar allows no token next (a dead end: it needs bytes
        that no token of the vocabulary holds)."""
        self._settle()
        matcher = self.matchers.get(request_id)
        if matcher is None or matcher.is_terminated():
            return False
        bits = np.empty((1, self.words), dtype=np.int32)
        matcher.fill_next_token_bitmask(bits, 0)
        return not bits.any()

    def bitmask(self, request_ids: list[str | None]) -> np.ndarray:
        """[len(request_ids), ceil(V / 32)] int32: each row's allowed next tokens, all bits
        set for rows without a live matcher (None, an ended request, or one whose grammar the
        last accept ended). Valid until the next call."""
        self._settle()
        return self._fill(*self._rows(request_ids))

    def start_bitmask(self, request_ids: list[str | None]) -> None:
        """Begin ``bitmask(request_ids)`` on the worker thread."""
        self._settle()
        self.pending = self.filler.submit(self._fill, *self._rows(request_ids))

    def wait_bitmask(self) -> np.ndarray:
        """The bitmask ``start_bitmask`` began."""
        pending, self.pending = self.pending, None
        assert pending is not None, "start_bitmask must come before wait_bitmask"
        return pending.result()

    def _settle(self) -> None:
        """Wait for a fill under way: the matchers are not to be touched during one."""
        if self.pending is not None:
            wait([self.pending])

    def _rows(self, request_ids: list[str | None]) -> tuple[np.ndarray, list, list[int]]:
        """The buffer rows for ``request_ids``, rows without a live matcher all ones, and the
        matchers and rows left to fill."""
        if len(self.buffer) < len(request_ids):
            self.buffer = np.empty((2 * len(request_ids), self.words), dtype=np.int32)
        bits = self.buffer[:len(request_ids)]
        matchers, rows = [], []
        for i, rid in enumerate(request_ids):
            if rid in self.matchers and rid not in self.terminated:
                matchers.append(self.matchers[rid])
                rows.append(i)
            else:
                bits[i] = -1
        return bits, matchers, rows

    def _fill(self, bits: np.ndarray, matchers: list, rows: list[int]) -> np.ndarray:
        if len(rows) < FEW_ROWS:  # the batch call's threads cost more than they save here
            for matcher, i in zip(matchers, rows):
                matcher.fill_next_token_bitmask(bits, i)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, bits, rows)
        return bits

    def close(self) -> None:
        self.filler.shutdown(wait=True)
