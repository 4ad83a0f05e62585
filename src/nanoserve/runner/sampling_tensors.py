"""A batch's sampling parameters and token histories as device tensors, built once per step."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanoserve.runner.packed_copy import packed_to_device
from nanoserve.sampling_params import SamplingParams

# Temperatures below this are sampled greedily: dividing logits by them can overflow float32,
# and the distribution they describe is the argmax anyway.
GREEDY_TEMPERATURE = 1e-5
FLOAT32_TINY = float(np.finfo(np.float32).tiny)
FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass
class SamplingTensors:
    """Per-step sampling parameters of a batch, as device tensors, made once per engine step by
    :meth:`build`; row ``i`` describes row ``i`` of the logits given to
    :class:`~nanoserve.runner.sampler.Sampler`. Settings that cannot change a row's result are
    normalised away (greedy rows carry temperature 0, no filter and no generator), and the
    host-side flags let a batch skip every stage no row uses without looking at device data."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_p: torch.Tensor  # [B] float32, 1 where off
    top_k: torch.Tensor  # [B] int64, vocab_size where off
    min_p: torch.Tensor  # [B] float32, 0 where off
    repetition_penalty: torch.Tensor  # [B] float32, 1 where off
    presence_penalty: torch.Tensor  # [B] float32
    frequency_penalty: torch.Tensor  # [B] float32
    prompt_tokens: torch.Tensor | None  # [B, Lp] int64 padded with vocab_size
    output_tokens: torch.Tensor | None  # [B, Lo] int64 padded with vocab_size
    banned_tokens: tuple[torch.Tensor, torch.Tensor] | None  # (rows [N], token ids [N]) int64
    # (rows [N], token ids [N]) int64 and the biases [N] float32 added to those logits
    logit_bias: tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None
    # rows that may sample only some tokens [R], and those (rows [N], token ids [N]), int64
    allowed_tokens: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None
    seeded_rows: list[tuple[int, torch.Generator]]  # (row, own generator) of seeded sampled rows
    all_greedy: bool
    all_random: bool  # no row is greedy
    max_top_k: int  # largest top-k of a row that uses it, 0 if none does
    any_top_p: bool
    any_min_p: bool
    any_count_penalty: bool  # some row uses a frequency or presence penalty
    max_logprobs: int  # largest number of top logprobs asked for, -1 if no row asked
    only_temperature: bool  # see temperatures_only: the batch may take the fused CUDA sampler
    noise_seed: torch.Tensor  # [1] int64, see draw_noise_seed; -1 when not only_temperature
    # Rows under a grammar [R] int64 and their next-token bitmasks [R, ceil(V / 32)] int32
    token_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, params: list[SamplingParams], prompt_token_ids: list[list[int]],
              output_token_ids: list[list[int]], banned_token_ids: list[list[int]],
              generators: list[torch.Generator | None], vocab_size: int,
              device: torch.device) -> SamplingTensors:
        """Gather a batch's parameters and token histories into tensors on ``device``.
        ``generators[i]`` is request ``i``'s own generator (on ``device``) when it has a seed.
        ``banned_token_ids[i]`` are the ids row ``i`` must not produce this step; ids outside
        the vocabulary are ignored. Token histories are only sent for rows whose penalties
        read them. All of it goes in one asynchronous copy (staged in pinned memory on CUDA)."""
        greedy = [p.temperature < GREEDY_TEMPERATURE for p in params]
        sampled = [not g for g in greedy]
        top_k = [min(p.top_k, vocab_size) if s and p.top_k > 0 else vocab_size
                 for p, s in zip(params, sampled)]
        # At least float32's smallest normal: a top_p that rounds to 0 would cut even the top
        # token (its mass before is 0), leaving nothing to sample.
        top_p = [max(p.top_p, FLOAT32_TINY) if s else 1.0 for p, s in zip(params, sampled)]
        min_p = [p.min_p if s else 0.0 for p, s in zip(params, sampled)]
        uses_repetition = [p.repetition_penalty != 1.0 for p in params]
        uses_count = [p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params]
        reads_output = [r or c for r, c in zip(uses_repetition, uses_count)]
        prompt = output = None
        if any(uses_repetition):
            prompt = _padded([ids if r else [] for ids, r in
                              zip(prompt_token_ids, uses_repetition)], vocab_size)
        if any(reads_output):
            output = _padded([ids if r else [] for ids, r in
                              zip(output_token_ids, reads_output)], vocab_size)
        banned = [(row, t) for row, ids in enumerate(banned_token_ids) for t in ids
                  if 0 <= t < vocab_size]
        bias = [(row, t, b) for row, p in enumerate(params) if p.logit_bias
                for t, b in p.logit_bias.items()]
        restricted = [row for row, p in enumerate(params) if p.allowed_token_ids]
        allowed = [(row, t) for row in restricted for t in params[row].allowed_token_ids]
        max_top_k = max((k for k in top_k if k < vocab_size), default=0)
        only_temperature = temperatures_only(params, banned_token_ids, generators,
                                             vocab_size) is not None
        noise_seed = draw_noise_seed(any(sampled)) if only_temperature else -1

        # One copy for everything the step's sampling reads on the device.
        no_history = np.empty(0, dtype=np.int64)
        # Biases and allowed lists are rare: their parts are only packed when some row has one.
        bias_parts = [([row for row, _, _ in bias], np.int64), ([t for _, t, _ in bias], np.int64),
                      ([b for _, _, b in bias], np.float32)] if bias else []
        allowed_parts = [(restricted, np.int64), ([row for row, _ in allowed], np.int64),
                         ([t for _, t in allowed], np.int64)] if allowed else []
        (temperature, top_p_t, min_p_t, repetition, presence, frequency, top_k_t, seed_t,
         banned_rows, banned_ids, prompt_flat, output_flat, *rare) = packed_to_device([
            ([p.temperature if s else 0.0 for p, s in zip(params, sampled)], np.float32),
            (top_p, np.float32),
            (min_p, np.float32),
            ([min(max(p.repetition_penalty, FLOAT32_TINY), FLOAT32_MAX) for p in params],
             np.float32),  # finite and nonzero in float32: no inf * 0
            ([p.presence_penalty for p in params], np.float32),
            ([p.frequency_penalty for p in params], np.float32),
            (top_k, np.int64),
            ([noise_seed], np.int64),
            ([row for row, _ in banned], np.int64),
            ([t for _, t in banned], np.int64),
            (no_history if prompt is None else prompt.ravel(), np.int64),
            (no_history if output is None else output.ravel(), np.int64),
            *bias_parts, *allowed_parts,
        ], device)
        bias_t, allowed_t = rare[:len(bias_parts)], rare[len(bias_parts):]

        return cls(
            temperature=temperature,
            top_p=top_p_t,
            top_k=top_k_t,
            min_p=min_p_t,
            repetition_penalty=repetition,
            presence_penalty=presence,
            frequency_penalty=frequency,
            prompt_tokens=None if prompt is None else prompt_flat.view(prompt.shape),
            output_tokens=None if output is None else output_flat.view(output.shape),
            banned_tokens=(banned_rows, banned_ids) if banned else None,
            logit_bias=((bias_t[0], bias_t[1]), bias_t[2]) if bias else None,
            allowed_tokens=(allowed_t[0], (allowed_t[1], allowed_t[2])) if allowed else None,
            seeded_rows=[(i, g) for i, (g, s) in enumerate(zip(generators, sampled))
                         if s and g is not None],
            all_greedy=not any(sampled),
            all_random=all(sampled),
            max_top_k=max_top_k,
            any_top_p=any(p < 1.0 for p in top_p),
            any_min_p=any(m > 0.0 for m in min_p),
            any_count_penalty=any(uses_count),
            max_logprobs=max_logprobs(params),
            only_temperature=only_temperature,
            noise_seed=seed_t,
        )


def temperatures_only(params: list[SamplingParams], banned_token_ids: list[list[int]],
                      generators: list[torch.Generator | None], vocab_size: int
                      ) -> np.ndarray | None:
    """Each row's temperature (float32, 0 where greedy) when no row of the batch needs more
    than its temperature (no penalty, bias, banned or allowed list, top-k / top-p / min-p
    filter or seeded generator), so that the fused sampler serves it; otherwise None. A
    grammar's bitmask does not count: it applies before the fused sampler too."""
    temperature = np.zeros(len(params), dtype=np.float32)
    for row, (p, banned, generator) in enumerate(zip(params, banned_token_ids, generators)):
        if (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                or p.presence_penalty != 0.0 or p.logit_bias or p.allowed_token_ids
                or any(0 <= t < vocab_size for t in banned)):
            return None
        if p.temperature < GREEDY_TEMPERATURE:
            continue
        if (0 < p.top_k < vocab_size or p.top_p < 1.0 or p.min_p > 0.0
                or generator is not None):
            return None
        temperature[row] = p.temperature
    return temperature


def draw_noise_seed(any_sampled: bool) -> int:
    """The fused sampler's noise seed for a step: from torch's default CPU generator (no device
    sync, and torch.manual_seed still makes runs reproducible); 0 when no row is drawn."""
    return int(torch.randint(2 ** 62, ())) if any_sampled else 0


def max_logprobs(params: list[SamplingParams]) -> int:
    """The largest number of top logprobs a row asked for, -1 if none asked."""
    return max((p.logprobs for p in params if p.logprobs is not None), default=-1)


def _padded(rows: list[list[int]], pad: int) -> np.ndarray:
    """[len(rows), longest] int64 array of ``rows``, right-padded with ``pad`` (filled through
    numpy, which is much faster than torch.tensor on long nested lists)."""
    out = np.full((len(rows), max(map(len, rows), default=0)), pad, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out
