"""Per-request sampling parameters, validated on construction."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

# Top logprobs a request may ask for per token by default (EngineConfig.max_logprobs; vLLM's).
MAX_LOGPROBS = 20

_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match, with vLLM's names; exactly one field is set:
    ``json`` a JSON schema (a dict or its text), ``regex``, ``choice`` (one of the strings),
    ``grammar`` (EBNF, as xgrammar reads it), ``json_object`` (any JSON object).
    ``disable_any_whitespace``: JSON without free whitespace (``", "`` and ``": "`` between
    items), which fills token masks several times faster than the default's up to
    16 whitespace characters between tokens."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of "
                             f"{', '.join(_CONSTRAINTS)}, got {given or 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or its "
                             f"text), got {type(value).__name__}")
        if kind in ("regex", "grammar") and not (isinstance(value, str) and value):
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string, got "
                             f"{value!r}")
        if kind == "choice" and (not isinstance(value, (list, tuple)) or not value or not all(
                isinstance(c, str) and c for c in value)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty "
                             f"strings, got {value!r}")
        if kind == "json_object" and value is not True:
            raise ValueError(f"structured_outputs.json_object must be true, got {value!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a boolean, got "
                             f"{self.disable_any_whitespace!r}")

    @property
    def kind(self) -> str:
        return next(name for name in _CONSTRAINTS if getattr(self, name) not in (None, False))

    def key(self) -> tuple[str, str, bool]:
        """The constraint as (kind, text, disable_any_whitespace): what compiled grammars are
        cached by."""
        value = getattr(self, self.kind)
        return (self.kind, value if isinstance(value, str) else json.dumps(value),
                self.disable_any_whitespace)


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop; mirrors vLLM's SamplingParams. An invalid
    field raises ValueError naming it and its allowed range."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    # Logprobs of every prompt token after the first (its own and the top ones), as vLLM's.
    prompt_logprobs: int | None = None
    # Added to the named tokens' logits before anything else (OpenAI's range, [-100, 100]).
    logit_bias: dict[int, float] | None = None
    # Only these tokens may be sampled (vLLM's): every other logit is -inf.
    allowed_token_ids: list[int] | None = None
    # Keep only the prompt's last k tokens (vLLM's; -1: as many as max_model_len allows).
    truncate_prompt_tokens: int | None = None
    n: int = 1  # independent samples of the prompt, sample k seeded seed + k (for_sample)
    structured_outputs: StructuredOutputsParams | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check_number("temperature", self.temperature, low=0.0, high=None, rule=">= 0")
        _check_number("top_p", self.top_p, low=0.0, high=1.0, rule="in (0, 1]", low_open=True)
        check_int("top_k", self.top_k, -1, rule="-1, 0 (disable) or >= 1")
        _check_number("min_p", self.min_p, low=0.0, high=1.0, rule="in [0, 1]")
        _check_number("repetition_penalty", self.repetition_penalty, low=0.0, high=None,
                      rule="> 0", low_open=True)
        _check_number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0,
                      rule="in [-2, 2]")
        _check_number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0,
                      rule="in [-2, 2]")
        if self.seed is not None:
            check_int("seed", self.seed, 0, 2**63 - 1, "in [0, 2**63)")
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens, 1)
        check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):  # the upper limit is the engine's
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 0)
        check_int("n", self.n, 1)
        if self.logit_bias is not None:
            self.logit_bias = _checked_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) \
                    or not self.allowed_token_ids or not all(
                        isinstance(t, int) and not isinstance(t, bool) and t >= 0
                        for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be a non-empty list of token ids "
                                 f"(integers >= 0), got {self.allowed_token_ids!r}")
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.truncate_prompt_tokens is not None:
            check_int("truncate_prompt_tokens", self.truncate_prompt_tokens)
            if self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1:
                raise ValueError("truncate_prompt_tokens must be >= 1, or -1 for max_model_len, "
                                 f"got {self.truncate_prompt_tokens}")
        self.stop_strings = self._normalise_stop(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers, "
                             f"got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of sample ``index`` of ``n``: one sequence, seeded ``seed + index``
        (if seeded) so the samples differ and each is reproducible alone."""
        seed = None if self.seed is None else (self.seed + index) % 2**63
        return replace(self, n=1, seed=seed)

    @property
    def needs_token_history(self) -> bool:
        """Whether sampling reads the tokens seen so far (the three penalties do)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @staticmethod
    def _normalise_stop(stop: str | list[str] | None) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        if any(s == "" for s in stop):
            raise ValueError("stop must not contain empty strings")
        return list(stop)


def _checked_bias(bias: object) -> dict[int, float]:
    rule = "logit_bias must map token ids (integers >= 0) to biases in [-100, 100], got"
    if not isinstance(bias, dict):
        raise ValueError(f"{rule} {bias!r}")
    for token, value in bias.items():
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise ValueError(f"{rule} the key {token!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not -100 <= value <= 100:
            raise ValueError(f"{rule} {value!r} for token {token}")
    return {token: float(value) for token, value in bias.items()}


def check_int(name: str, value: object, low: int | None = None, high: int | None = None,
              rule: str | None = None) -> None:
    """A ValueError naming ``name`` unless ``value`` is an int (a bool is not one) in
    [``low``, ``high``] (None: unbounded); ``rule`` words the range, default ``>= low``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be {rule or f'>= {low}'}, got {value}")


def _check_number(name: str, value: object, *, low: float | None, high: float | None,
                  rule: str, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number {rule}, got {value!r}")
    # JSON's 1e309 parses as inf, NaN passes every comparison, an int may pass any float.
    number = float(value) if isinstance(value, float) or value.bit_length() < 1024 else math.inf
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number {rule}, got {number}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and value > high
    if too_low or too_high:
        raise ValueError(f"{name} must be {rule}, got {value}")
