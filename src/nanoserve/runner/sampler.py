"""Turn each sequence's last-position logits into its next token, vectorised over the batch.

Pipeline, with vLLM's semantics, all in float32: tokens a grammar forbids -> -inf; logit
biases; tokens outside an allowed list and banned tokens -> -inf; repetition penalty (prompt
+ output tokens), then frequency and presence penalties (output tokens). Greedy rows take the
argmax of the penalised logits; the other rows are divided by their temperature, filtered by
top-k, then top-p, then min-p, and drawn from the softmax with the exponential race.
Parameters are tensor rows, so a step costs a fixed number of kernels whatever the batch. On
CUDA, a batch that needs nothing but greedy or temperature sampling (and grammar bitmasks)
takes one fused Triton pass instead (``nanoserve.kernels.sampling``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.runner.inputs import FAILED_ROW
from nanoserve.runner.sampling_tensors import SamplingTensors

_NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    """The sampled tokens of one step and, when some row asked, their logprobs: from the
    log-softmax of the raw logits (before penalties, temperature and filters), as vLLM reports
    by default. Every row gets ``max_logprobs`` top entries; one that asked fewer keeps the first.
    """

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B, 1 + max_logprobs] float32: sampled token, then top-k
    logprob_token_ids: torch.Tensor | None  # [B, 1 + max_logprobs] int64, same layout


class Sampler(torch.nn.Module):
    """Picks the next token of every row of a batch of logits, without a host-device sync
    (the caller reads ``token_ids`` back once)."""

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
    """True for CUDA logits when no row needs more than its temperature."""
    return logits.is_cuda and logits.stride(-1) == 1 and tensors.only_temperature


def _fused_sample(logits: torch.Tensor, tensors: SamplingTensors) -> SamplerOutput:
    """Greedy and temperature rows in one Triton pass (same distribution as the general path)."""
    from nanoserve.kernels.sampling import sample_tokens

    token_ids = sample_tokens(logits, tensors.temperature, tensors.noise_seed,
                              bitmask=tensors.token_bitmask)
    return with_fused_logprobs(logits, token_ids, tensors.max_logprobs)


def with_fused_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                        max_logprobs: int) -> SamplerOutput:
    """The fused sampler's ``token_ids`` for ``logits``, with their raw logprobs when some row
    asked (``max_logprobs`` >= 0): the float32 copy of the logits is only made for those."""
    if max_logprobs < 0:
        return SamplerOutput(token_ids, None, None)
    return _with_logprobs(logits.float(), token_ids, max_logprobs)


def mark_failed_rows(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``token_ids`` with FAILED_ROW where the row's logits hold a NaN or +inf, or are all
    -inf: its "sample" means nothing, and the engine fails that request alone. One reduction
    over the logits, on the device, so it costs no extra sync."""
    return token_ids.masked_fill(~logits.amax(dim=-1).isfinite(), FAILED_ROW)


def apply_penalties(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """``logits`` [B, V] (not modified) after the biases, allowed and banned lists and the
    penalties. Repetition (prompt or output tokens): a positive logit is divided by the penalty,
    any other multiplied by it; then each output token loses ``frequency * count + presence``.
    Tokens a row's grammar does not allow next are -inf before all of it."""
    logits = apply_bitmask(logits, tensors.token_bitmask)
    if tensors.logit_bias is not None:
        index, bias = tensors.logit_bias
        logits = logits.index_put(index, bias, accumulate=True)
    if tensors.allowed_tokens is not None:
        rows, allowed = tensors.allowed_tokens
        keep = torch.ones_like(logits, dtype=torch.bool)
        keep[rows] = False
        keep[allowed] = True
        logits = logits.masked_fill(~keep, _NEG_INF)
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
        # An extreme penalty must not overflow a finite logit: the token is penalised, never
        # made impossible (a grammar's only token) or certain; masked ones stay -inf.
        finite = torch.finfo(logits.dtype)
        penalised = torch.where(logits == _NEG_INF, logits,
                                penalised.clamp(finite.min, finite.max))
        logits = torch.where(seen, penalised, logits)
    if tensors.any_count_penalty:
        counts = _token_counts(tensors.output_tokens, vocab_size)
        logits = (logits - tensors.frequency_penalty[:, None] * counts
                  - tensors.presence_penalty[:, None] * (counts > 0))
    return logits


def filter_logits(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """Penalised ``logits`` (not modified) divided by temperature, with tokens cut by top-k,
    top-p and min-p (in that order) at -inf: what sampled rows draw from. Greedy rows come back
    unscaled and unfiltered."""
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
    probability p_i. Unseeded rows share one batched draw; a seeded row redraws its q (V values)
    from its own generator, so its tokens depend only on its seed and logits, not the batch."""
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


def apply_bitmask(logits: torch.Tensor,
                  bitmask: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """``logits`` (not modified) with -inf where ``bitmask`` (rows, bits) forbids a token."""
    if bitmask is None:
        return logits
    rows, bits = bitmask
    allowed = unpack_bitmask(bits, logits.shape[-1])
    return logits.index_put((rows,), logits[rows].masked_fill(~allowed, _NEG_INF))


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] bool from [R, ceil(V / 32)] int32 bitmasks: token t is bit t % 32 of word t // 32."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    return ((bits[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab_size]


def _token_mask(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] bool: which ids occur in each row of ``tokens`` (padding id = vocab_size)."""
    mask = torch.zeros(tokens.shape[0], vocab_size + 1, dtype=torch.bool, device=tokens.device)
    return mask.scatter_(1, tokens, True)[:, :vocab_size]


def _token_counts(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32: how often each id occurs in each row of ``tokens`` (padding = vocab_size)."""
    counts = torch.zeros(tokens.shape[0], vocab_size + 1, device=tokens.device)
    ones = torch.ones(tokens.shape, device=tokens.device)
    return counts.scatter_add_(1, tokens, ones)[:, :vocab_size]
