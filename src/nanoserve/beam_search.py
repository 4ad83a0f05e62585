"""Beam search over the engine: ``LLM.beam_search(prompts, BeamSearchParams(...))``.

As in vLLM, beam search is a loop around the engine rather than a mode of it: each step asks
the engine for one token of every live beam, with the top ``2 * beam_width`` logprobs, and the
loop keeps the best. Prefix caching makes re-submitting a beam's tokens cost about one new
token each step. The rules are transformers' beam search with ``early_stopping=True``:

- the candidates are the ``2 * beam_width`` best (beam, token) continuations by cumulative
  logprob; walking them best first, an EOS ranked within the first ``beam_width`` ends a
  hypothesis, and the first ``beam_width`` others become the next beams;
- a prompt is done once it has ``beam_width`` hypotheses, or after ``max_tokens`` steps, when
  its live beams become hypotheses too;
- a hypothesis scores ``cumulative logprob / generated_length ** length_penalty`` (an ending
  EOS counted in the length, as transformers 5 counts it), and the best ``beam_width`` come
  back, best first.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nanoserve.prompts import as_prompt_list
from nanoserve.sampling_params import MAX_LOGPROBS, SamplingParams

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
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) \
                or not 1 <= self.beam_width <= widest:
            raise ValueError(f"beam_width must be an integer in [1, {widest}] (each step reads "
                             f"2 * beam_width logprobs), got {self.beam_width!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.length_penalty, int | float) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")


@dataclass
class BeamSequence:
    """One hypothesis: its generated tokens (ending with the EOS if one ended it), their
    cumulative logprob, its score and its text."""

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


def beam_search(llm: LLM, prompts: str | Sequence[str] | Sequence[list[int]],
                params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Beam search of every prompt (see the module docstring), the prompts batched together."""
    prompt_ids = [p if isinstance(p, list) else llm.tokenizer.encode(p)
                  for p in as_prompt_list(prompts)]
    eos = frozenset() if params.ignore_eos else frozenset(llm.engine.model_config.eos_token_ids)
    width = params.beam_width
    step_params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * width,
                                 ignore_eos=True)
    live = [[BeamSequence([], 0.0)] for _ in prompt_ids]
    done: list[list[BeamSequence]] = [[] for _ in prompt_ids]
    for _ in range(params.max_tokens):
        asking = [(i, beam) for i, beams in enumerate(live) for beam in beams]
        if not asking:
            break
        outs = llm.generate([prompt_ids[i] + beam.token_ids for i, beam in asking],
                            step_params, use_tqdm=False)
        candidates: list[list[BeamSequence]] = [[] for _ in prompt_ids]
        for (i, beam), out in zip(asking, outs):
            top = sorted(out.outputs[0].logprobs[0].items(), key=lambda kv: -kv[1])[:2 * width]
            candidates[i] += [BeamSequence(beam.token_ids + [token],
                                           beam.cumulative_logprob + logprob)
                              for token, logprob in top]
        for i, options in enumerate(candidates):
            if not options:
                continue
            options.sort(key=lambda c: -c.cumulative_logprob)
            live[i] = []
            for rank, candidate in enumerate(options[:2 * width]):
                if candidate.token_ids[-1] in eos:
                    if rank < width:
                        candidate.finished = True
                        _keep(done[i], candidate, params.length_penalty, width)
                elif len(live[i]) < width:
                    live[i].append(candidate)
            if len(done[i]) >= width:
                live[i] = []
    outputs = []
    for i, ids in enumerate(prompt_ids):
        for beam in live[i]:  # out of steps: the live beams compete with the ended ones
            _keep(done[i], beam, params.length_penalty, width)
        best = sorted(done[i], key=lambda h: -h.score)
        for hypothesis in best:
            hypothesis.text = llm.tokenizer.decode(hypothesis.token_ids, skip_special_tokens=True)
        outputs.append(BeamSearchOutput(ids, best))
    return outputs


def _keep(hypotheses: list[BeamSequence], candidate: BeamSequence, length_penalty: float,
          width: int) -> None:
    """Score ``candidate`` and add it to ``hypotheses``, keeping the ``width`` best."""
    candidate.score = candidate.cumulative_logprob / len(candidate.token_ids) ** length_penalty
    hypotheses.append(candidate)
    if len(hypotheses) > width:
        hypotheses.remove(min(hypotheses, key=lambda h: h.score))
