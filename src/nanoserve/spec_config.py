"""Speculative decoding's settings (vLLM's ``speculative_config``), validated."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from nanoserve.sampling_params import check_int

SPEC_METHODS = ("ngram", "draft_model")
# Most proposals one verify step scores per sequence: k + 1 logit rows per sequence, and
# acceptance past a handful of tokens is rare enough that longer drafts only cost.
MAX_SPECULATIVE_TOKENS = 16


@dataclass
class SpeculativeConfig:
    """How sequences propose tokens for the target model to verify in one forward.

    ``ngram``: prompt lookup, the longest suffix n-gram of ``prompt_lookup_min`` to
    ``prompt_lookup_max`` tokens found earlier in the sequence proposes the tokens that
    followed it. ``draft_model``: a smaller model at ``model`` (same tokenizer) proposes.
    ``disable_when_slower``: steps run without proposals at batch sizes where measured output
    rates show plain decoding faster (engine/spec_gate.py); a seeded sampled request's tokens
    then depend on which steps speculated, so set it False where those must reproduce.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    disable_when_slower: bool = True

    def __post_init__(self) -> None:
        where = "speculative_config"
        if not isinstance(self.disable_when_slower, bool):
            raise ValueError(f"{where}.disable_when_slower must be true or false, got "
                             f"{self.disable_when_slower!r}")
        if self.method not in SPEC_METHODS:
            raise ValueError(f"{where}.method must be one of {', '.join(SPEC_METHODS)}, "
                             f"got {self.method!r}")
        check_int(f"{where}.num_speculative_tokens", self.num_speculative_tokens, 1,
                  MAX_SPECULATIVE_TOKENS, f"in [1, {MAX_SPECULATIVE_TOKENS}]")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError(f"{where}.model is only for method 'draft_model'")
            # vLLM's defaults: either bound alone sets both; neither means 5.
            low, high = self.prompt_lookup_min, self.prompt_lookup_max
            for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
                if value is not None:
                    check_int(f"{where}.{name}", value, 1)
            if low is None and high is None:
                low = high = 5
            low, high = (high if low is None else low), (low if high is None else high)
            if low > high:
                raise ValueError(f"{where}.prompt_lookup_min ({low}) must be <= "
                                 f"prompt_lookup_max ({high})")
            self.prompt_lookup_min, self.prompt_lookup_max = low, high
        else:
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{where}.{name} is only for method 'ngram'")
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(f"{where}.model (the draft model's path) is required for "
                                 "method 'draft_model'")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None
              ) -> SpeculativeConfig | None:
        """From a dict (the Python API), a JSON object (the CLI's ``--speculative-config``) or
        None; unknown keys are errors, never ignored."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a dict (or a JSON object), "
                             f"got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; "
                             f"known: {sorted(known)}")
        return cls(**value)
