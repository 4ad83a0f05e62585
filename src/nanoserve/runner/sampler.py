"""Turn each sequence's last-position logits into its next token, vectorised over the batch.

Pipeline, with vLLM's semantics, all in float32: banned tokens -> -inf; repetition penalty
(prompt + output tokens), then frequency and presence penalties (output tokens). Greedy rows take
the argmax of the penalised logits; the other rows are divided by their temperature, filtered by
top-k, then top-p, then min-p, and drawn from the softmax with the exponential race.
Everything per request is a tensor row, so one step costs a fixed number of kernels whatever the
batch; the only Python loop is over rows with their own seeded generator. On CUDA, a batch that
needs nothing but greedy or temperature sampling takes one fused Triton pass instead
(``nanoserve.kernels.sampling``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from nanoserve.sampling_params import SamplingParams

# Temperatures below this are sampled greedily: dividing logits by them can overflow float32,
# and the distribution they describe is the argmax anyway.
GREEDY_TEMPERATURE = 1e-5

_NEG_INF = float("-inf")


@dataclass
class SamplingTensors:
    """Per-step sampling parameters of a batch, as device tensors.

    Made once per engine step by :meth:`build`; row ``i`` describes row ``i`` of the logits given
    to :class:`Sampler`. Settings that cannot change a row's result are normalised away (greedy
    rows carry temperature 0, no filter and no generator), and the host-side flags let a batch
    skip every stage no row uses without looking at device data.
    """

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
    generators: list[torch.Generator | None]  # a seeded sampled row's own generator, else None
    all_greedy: bool
    all_random: bool  # no row is greedy
    max_top_k: int  # largest top-k of a row that uses it, 0 if none does
    any_top_p: bool
    any_min_p: bool
    any_count_penalty: bool  # some row uses a frequency or presence penalty
    max_logprobs: int  # largest number of top logprobs asked for, -1 if no row asked
    seeded_rows: list[tuple[int, torch.Generator]] = field(init=False)

    def __post_init__(self) -> None:
        self.seeded_rows = [(i, g) for i, g in enumerate(self.generators) if g is not None]

    @classmethod
    def build(cls, params: list[SamplingParams], prompt_token_ids: list[list[int]],
              output_token_ids: list[list[int]], banned_token_ids: list[list[int]],
              generators: list[torch.Generator | None], vocab_size: int,
              device: torch.device) -> SamplingTensors:
        """Gather a batch's parameters and token histories into tensors on ``device``.

        ``generators[i]`` is request ``i``'s own generator (on ``device``) when it has a seed.
        ``banned_token_ids[i]`` are the ids row ``i`` must not produce this step; ids outside
        the vocabulary are ignored. Token histories are only sent for rows whose penalties
        read them. On CUDA the copies are asynchronous (staged in pinned memory).
        """
        device = torch.device(device)
        greedy = [p.temperature < GREEDY_TEMPERATURE for p in params]
        sampled = [not g for g in greedy]
        top_k = [min(p.top_k, vocab_size) if s and p.top_k > 0 else vocab_size
                 for p, s in zip(params, sampled)]
        top_p = [p.top_p if s else 1.0 for p, s in zip(params, sampled)]
        min_p = [p.min_p if s else 0.0 for p, s in zip(params, sampled)]
        floats = _to_device(torch.tensor([
            [p.temperature if s else 0.0 for p, s in zip(params, sampled)],
            top_p,
            min_p,
            [p.repetition_penalty for p in params],
            [p.presence_penalty for p in params],
            [p.frequency_penalty for p in params],
        ], dtype=torch.float32), device)
        temperature, top_p_t, min_p_t, repetition, presence, frequency = floats.unbind(0)

        uses_repetition = [p.repetition_penalty != 1.0 for p in params]
        uses_count = [p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params]
        reads_output = [r or c for r, c in zip(uses_repetition, uses_count)]
        prompt_tokens = output_tokens = None
        if any(uses_repetition):
            prompt_tokens = _padded([ids if r else [] for ids, r in
                                     zip(prompt_token_ids, uses_repetition)], vocab_size, device)
        if any(reads_output):
            output_tokens = _padded([ids if r else [] for ids, r in
                                     zip(output_token_ids, reads_output)], vocab_size, device)

        banned = [(row, t) for row, ids in enumerate(banned_token_ids) for t in ids
                  if 0 <= t < vocab_size]
        banned_tokens = None
        if banned:
            rows, cols = _to_device(torch.tensor(list(zip(*banned))), device).unbind(0)
            banned_tokens = (rows, cols)

        return cls(
            temperature=temperature,
            top_p=top_p_t,
            top_k=_to_device(torch.tensor(top_k, dtype=torch.int64), device),
            min_p=min_p_t,
            repetition_penalty=repetition,
            presence_penalty=presence,
            frequency_penalty=frequency,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            banned_tokens=banned_tokens,
            generators=[g if s else None for g, s in zip(generators, sampled)],
            all_greedy=not any(sampled),
            all_random=all(sampled),
            max_top_k=max((k for k in top_k if k < vocab_size), default=0),
            any_top_p=any(p < 1.0 for p in top_p),
            any_min_p=any(m > 0.0 for m in min_p),
            any_count_penalty=any(uses_count),
            max_logprobs=max((p.logprobs for p in params if p.logprobs is not None),
                             default=-1),
        )


@dataclass
class SamplerOutput:
    """The sampled tokens of one step and, when some row asked, their logprobs.

    Logprobs come from the log-softmax of the model's raw logits (before penalties, temperature
    and filters), as vLLM reports by default. Every row gets ``max_logprobs`` top entries; a row
    that asked for fewer keeps the first ones.
    """

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B, 1 + max_logprobs] float32: sampled token, then top-k
    logprob_token_ids: torch.Tensor | None  # [B, 1 + max_logprobs] int64, same layout


class Sampler(torch.nn.Module):
    """Picks the next token of every row of a batch of logits, per-row parameters and all.

    Issues no host-device synchronisation: the caller reads ``token_ids`` back once.
    """

    def forward(self, logits: torch.Tensor, tensors: SamplingTensors) -> SamplerOutput:
        if _fused_path_applies(logits, tensors):
            return _fused_sample(logits, tensors)
        raw = logits.float()
        penalised = apply_penalties(raw, tensors)
        if tensors.all_greedy:
            token_ids = penalised.argmax(dim=-1)
        else:
            probs = filter_logits(penalised, tensors).softmax(dim=-1)
            token_ids = _exponential_race(probs, tensors.seeded_rows)
            if not tensors.all_random:
                token_ids = torch.where(tensors.temperature == 0.0,
                                        penalised.argmax(dim=-1), token_ids)
        return _with_logprobs(raw, token_ids, tensors.max_logprobs)


def _fused_path_applies(logits: torch.Tensor, tensors: SamplingTensors) -> bool:
    """True for CUDA logits when no row needs more than its temperature: no penalty, banned
    token, top-k / top-p / min-p filter or seeded generator."""
    return (logits.is_cuda and logits.stride(-1) == 1
            and tensors.prompt_tokens is None and not tensors.any_count_penalty
            and tensors.banned_tokens is None
            and not (tensors.max_top_k or tensors.any_top_p or tensors.any_min_p)
            and not tensors.seeded_rows)


def _fused_sample(logits: torch.Tensor, tensors: SamplingTensors) -> SamplerOutput:
    """Greedy and temperature rows in one Triton pass (same distribution as the general path);
    the float32 copy of the logits is only made for logprobs."""
    from nanoserve.kernels.sampling import gumbel_max_sample

    # The seed comes from the default CPU generator: no device sync, and torch.manual_seed still
    # makes runs reproducible. A greedy batch draws nothing, as on the general path.
    seed = 0 if tensors.all_greedy else int(torch.randint(2 ** 62, ()))
    token_ids = gumbel_max_sample(logits, tensors.temperature, seed)
    if tensors.max_logprobs < 0:
        return SamplerOutput(token_ids, None, None)
    return _with_logprobs(logits.float(), token_ids, tensors.max_logprobs)


def apply_penalties(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """Return ``logits`` [B, V] with banned tokens at -inf and the three penalties applied.

    Repetition penalty (tokens of the prompt or the output): a positive logit is divided by the
    penalty, any other multiplied by it. Then each output token's logit loses
    ``frequency * count + presence``. The input is not modified.
    """
    if tensors.banned_tokens is not None:
        # A device-side fill, not a Python scalar, so no host-to-device copy is needed.
        neg_inf = torch.full((), _NEG_INF, device=logits.device)
        logits = logits.index_put(tensors.banned_tokens, neg_inf)
    vocab_size = logits.shape[-1]
    if tensors.prompt_tokens is not None:
        seen = (_token_mask(tensors.prompt_tokens, vocab_size)
                | _token_mask(tensors.output_tokens, vocab_size))
        penalty = tensors.repetition_penalty[:, None]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if tensors.any_count_penalty:
        counts = _token_counts(tensors.output_tokens, vocab_size)
        logits = (logits - tensors.frequency_penalty[:, None] * counts
                  - tensors.presence_penalty[:, None] * (counts > 0))
    return logits


def filter_logits(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """Return penalised ``logits`` divided by temperature, with tokens cut by top-k, top-p and
    min-p (in that order) at -inf; ``softmax`` of the result is what sampled rows draw from.

    Greedy rows come back unscaled and unfiltered. The input is not modified.
    """
    # Greedy rows are divided by 1: their result is discarded for the argmax anyway.
    temperature = torch.where(tensors.temperature == 0.0, 1.0, tensors.temperature)
    logits = logits / temperature[:, None]
    if tensors.any_top_p:
        logits = _top_k_top_p(logits, tensors.top_k, tensors.top_p)
    elif tensors.max_top_k:
        logits = _top_k(logits, tensors.top_k, tensors.max_top_k)
    if tensors.any_min_p:
        probs = logits.softmax(dim=-1)
        too_unlikely = probs < tensors.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(too_unlikely, _NEG_INF)
    return logits


def _top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits (ties with the k-th too), without a full sort."""
    kth_index = (top_k.clamp(max=max_top_k) - 1)[:, None]
    kth = logits.topk(max_top_k, dim=-1).values.gather(1, kth_index)
    is_off = (top_k >= logits.shape[-1])[:, None]
    return logits.masked_fill((logits < kth) & ~is_off, _NEG_INF)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k, then top-p on the renormalised survivors: keep the most likely tokens until their
    mass reaches ``top_p`` (the top token always stays), all on one descending sort."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    remove = sorted_logits < sorted_logits.gather(1, (top_k - 1)[:, None])
    probs = sorted_logits.masked_fill(remove, _NEG_INF).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # Rows with top_p == 1 are skipped: rounding can push the cumulative mass to 1 early.
    remove |= (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    remove_in_vocab_order = torch.empty_like(remove).scatter_(1, order, remove)
    return logits.masked_fill(remove_in_vocab_order, _NEG_INF)


def _exponential_race(probs: torch.Tensor,
                      seeded_rows: list[tuple[int, torch.Generator]]) -> torch.Tensor:
    """Draw one token per row: with q_i ~ Exp(1), argmax_i p_i / q_i is token i with
    probability p_i (normalisation is not needed).

    Unseeded rows share one batched draw from the default generator; a seeded row overwrites
    its q with exactly one draw of V values from its own generator, so its tokens depend only
    on its seed and its own logits, not on the rest of the batch.
    """
    q = torch.empty_like(probs).exponential_()
    for row, generator in seeded_rows:
        q[row].exponential_(generator=generator)
    # A draw of exactly 0 would make 0 / 0 = NaN on a filtered token, which argmax would pick.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)


def _with_logprobs(raw_logits: torch.Tensor, token_ids: torch.Tensor,
                   max_logprobs: int) -> SamplerOutput:
    """Pack the sampled ids with the raw logprobs of the sampled and the top tokens."""
    if max_logprobs < 0:
        return SamplerOutput(token_ids, None, None)
    logprobs = raw_logits.log_softmax(dim=-1)
    top_ids = logprobs.topk(max_logprobs, dim=-1).indices
    ids = torch.cat([token_ids[:, None], top_ids], dim=1)
    return SamplerOutput(token_ids, logprobs.gather(1, ids), ids)


def _token_mask(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] bool: which ids occur in each row of ``tokens`` (padding id = vocab_size)."""
    mask = torch.zeros(tokens.shape[0], vocab_size + 1, dtype=torch.bool, device=tokens.device)
    return mask.scatter_(1, tokens, True)[:, :vocab_size]


def _token_counts(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32: how often each id occurs in each row of ``tokens`` (padding = vocab_size)."""
    counts = torch.zeros(tokens.shape[0], vocab_size + 1, device=tokens.device)
    ones = torch.ones(tokens.shape, device=tokens.device)
    return counts.scatter_add_(1, tokens, ones)[:, :vocab_size]


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """[len(rows), longest] int64 tensor of ``rows`` on ``device``, right-padded with ``pad``."""
    # Filled row by row through numpy: several times faster than torch.tensor on nested lists,
    # which matters for long prompts.
    out = np.full((len(rows), max(map(len, rows), default=0)), pad, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return _to_device(torch.from_numpy(out), device)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``; staged in pinned memory on CUDA so the copy is asynchronous."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
