"""Beam search (``LLM.beam_search``, the server's ``use_beam_search``) around the engine, as in
vLLM: each step asks for one token of every live beam with the top ``2 * beam_width`` logprobs.
The rules are transformers' with ``early_stopping=True``: of the ``2 * beam_width`` best
continuations, an EOS ranked within the first ``beam_width`` ends a hypothesis and the first
``beam_width`` others are the next beams; a prompt is done at ``beam_width`` hypotheses or after
``max_tokens`` steps; a hypothesis scores ``cumulative logprob / length ** length_penalty``
(an ending EOS counted, as transformers 5 does).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nanoserve.prompts import as_prompt_list
from nanoserve.sampling_params import MAX_LOGPROBS, SamplingParams, check_int

if TYPE_CHECKING:
    from nanoserve.llm import LLM


@dataclass(frozen=True)
class BeamSearchParams:
    """Options of one beam search (vLLM's names). With ``ignore_eos`` EOS is an ordinary token."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        widest = MAX_LOGPROBS // 2
        check_int("beam_width", self.beam_width, 1, widest,
                  f"in [1, {widest}] (each step reads 2 * beam_width logprobs)")
        check_int("max_tokens", self.max_tokens, 1)
        penalty = self.length_penalty
        if not isinstance(penalty, int | float) or not math.isfinite(penalty):
            raise ValueError(f"length_penalty must be a finite number, got {penalty!r}")


@dataclass
class BeamSequence:
    """One hypothesis: its generated tokens (with the EOS that ended it, if one did)."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float = 0.0
    text: str = ""
    finished: bool = False  # ended by an EOS rather than by max_tokens


@dataclass
class BeamSearchOutput:
    """A prompt's best ``beam_width`` hypotheses, best first."""

    prompt_token_ids: list[int]
    sequences: list[BeamSequence] = field(default_factory=list)


class BeamSearch:
    """One beam search's state over a batch of prompts, whoever drives the engine: until
    ``done``, run ``requests()`` with ``step_params`` and pass ``advance()`` their logprobs."""

    def __init__(self, prompt_ids: list[list[int]], params: BeamSearchParams,
                 eos_token_ids: Sequence[int]):
        self.prompt_ids = prompt_ids
        self.params = params
        self.eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.step_params = SamplingParams(temperature=0.0, max_tokens=1,
                                          logprobs=2 * params.beam_width, ignore_eos=True)
        self.live = [[BeamSequence([], 0.0)] for _ in prompt_ids]
        self.ended: list[list[BeamSequence]] = [[] for _ in prompt_ids]
        self.steps = 0
        self._asking: list[tuple[int, BeamSequence]] = []

    @property
    def done(self) -> bool:
        return self.steps == self.params.max_tokens or not any(self.live)

    def requests(self) -> list[list[int]]:
        """Prompt + tokens of every live beam, prompt by prompt."""
        self._asking = [(i, beam) for i, beams in enumerate(self.live) for beam in beams]
        return [self.prompt_ids[i] + beam.token_ids for i, beam in self._asking]

    def advance(self, top_logprobs: list[dict[int, float]]) -> None:
        """One step, from the logprobs the engine gave each of ``requests()``, in its order."""
        width = self.params.beam_width
        candidates: list[list[BeamSequence]] = [[] for _ in self.prompt_ids]
        for (i, beam), logprobs in zip(self._asking, top_logprobs, strict=True):
            top = sorted(logprobs.items(), key=lambda kv: -kv[1])[:2 * width]
            candidates[i] += [BeamSequence(beam.token_ids + [token],
                                           beam.cumulative_logprob + logprob)
                              for token, logprob in top]
        for i, options in enumerate(candidates):
            if not options:
                continue
            options.sort(key=lambda c: -c.cumulative_logprob)
            self.live[i] = []
            for rank, candidate in enumerate(options[:2 * width]):
                if candidate.token_ids[-1] in self.eos:
                    if rank < width:
                        candidate.finished = True
                        self._keep(i, candidate)
                elif len(self.live[i]) < width:
                    self.live[i].append(candidate)
            if len(self.ended[i]) >= width:
                self.live[i] = []
        self.steps += 1

    def results(self, decode: Callable[[list[int]], str]) -> list[BeamSearchOutput]:
        """Each prompt's best hypotheses, best first, with ``decode``'s text."""
        outputs = []
        for i, ids in enumerate(self.prompt_ids):
            for beam in self.live[i]:  # out of steps: the live beams compete with the ended ones
                self._keep(i, beam)
            self.live[i] = []
            best = sorted(self.ended[i], key=lambda h: -h.score)
            for hypothesis in best:
                hypothesis.text = decode(hypothesis.token_ids)
            outputs.append(BeamSearchOutput(ids, best))
        return outputs

    def _keep(self, i: int, candidate: BeamSequence) -> None:
        """Score ``candidate`` and add it to prompt ``i``'s hypotheses, keeping the best."""
        candidate.score = (candidate.cumulative_logprob
                           / len(candidate.token_ids) ** self.params.length_penalty)
        hypotheses = self.ended[i]
        hypotheses.append(candidate)
        if len(hypotheses) > self.params.beam_width:
            hypotheses.remove(min(hypotheses, key=lambda h: h.score))


def beam_search(llm: LLM, prompts: str | Sequence[str] | Sequence[list[int]],
                params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Beam search of every prompt, the prompts batched together."""
    prompt_ids = [p if isinstance(p, list) else llm.tokenizer.encode(p)
                  for p in as_prompt_list(prompts)]
    search = BeamSearch(prompt_ids, params, llm.engine.model_config.eos_token_ids)
    while not search.done:
        outs = llm.generate(search.requests(), search.step_params, use_tqdm=False)
        search.advance([out.outputs[0].logprobs[0] for out in outs])
    return search.results(lambda ids: llm.tokenizer.decode(ids, skip_special_tokens=True))
