"""``nanoserve tune``'s attention sweeps: decode (16-bit or fp8 cache, finishing new tokens
or not), latent attention's decode, prefill, and the q/k-norm + RoPE + store launch, on caches
of the model's heads at each bucket (see ``sweeps.py``)."""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch

from nanoserve.config import ModelConfig
from nanoserve.kernels import decode_attention as decode
from nanoserve.kernels import fused_ops, mla_decode, prefill_attention, qk_norm_rope
from nanoserve.kernels.common import device_sm_count
from nanoserve.kernels.sweeps import BLOCK_SIZE, Sweep, copies_for, heads_of, randn

# A prefill step's chunk: sequences of new tokens, no cached prefix (a long prompt's first).
PREFILL_SEQS, PREFILL_TOKENS = 4, 2048
# Decode buckets past this many cached tokens are skipped: no KV cache holds them.
MAX_BATCH_TOKENS = 1 << 21


def _decode_buckets(cfg: ModelConfig, batches: Sequence[int], contexts: Sequence[int]
                    ) -> Iterator[tuple[int, int, int]]:
    """(batch, context, cache blocks a sequence) of each decode bucket the model can reach."""
    for batch in batches:
        for context in contexts:
            if context <= cfg.max_position_embeddings and batch * context <= MAX_BATCH_TOKENS:
                yield batch, context, math.ceil(context / BLOCK_SIZE)


def decode_sweeps(cfg: ModelConfig, tp: int, device: torch.device, batches: Sequence[int],
                  contexts: Sequence[int], fp8: bool = False,
                  dtype: torch.dtype = torch.bfloat16) -> Iterator[Sweep]:
    """Decode attention at each batch and context bucket (full contexts: a graph's worst
    case), plain and, for latency-bound batches, finishing the new tokens; over an fp8 cache
    with ``fp8``."""
    if cfg.mla:
        return  # latent attention has its own kernel (mla_sweeps)
    heads, kv_heads, head_dim = heads_of(cfg, tp)
    sms = device_sm_count(device)
    gen = torch.Generator(device=device).manual_seed(0)
    for batch, context, blocks in _decode_buckets(cfg, batches, contexts):
        kv_bytes = 2 * batch * blocks * BLOCK_SIZE * kv_heads * head_dim * (1 if fp8 else 2)
        copies = copies_for(kv_bytes)
        shape = (copies * batch * blocks, BLOCK_SIZE, kv_heads, head_dim)
        k_cache, v_cache = (torch.randn(shape, generator=gen, device=device, dtype=dtype)
                            .to(torch.float8_e4m3fn if fp8 else dtype) for _ in range(2))
        order = torch.randperm(shape[0], generator=gen, device=device).to(torch.int32)
        tables = order.view(copies, batch, blocks)
        q = torch.randn(batch, heads, head_dim, generator=gen, device=device, dtype=dtype)
        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
        finishing = (False, True) if batch <= decode.LATENCY_MAX_SEQS else (False,)
        for new_tokens in finishing:
            new = (_new_tokens(q, kv_heads, tables, context, cfg.qk_norm, gen) if new_tokens
                   else None)

            def run(config: decode.DecodeTuning, i: int, new=new, q=q, k_cache=k_cache,
                    v_cache=v_cache, tables=tables, lens=lens, starts=starts,
                    context=context) -> torch.Tensor:
                return decode.decode_attention(
                    q, k_cache, v_cache, tables[i], lens, starts, context, head_dim ** -0.5,
                    tuning=config, new_tokens=new if new is None else new(i))

            yield Sweep("decode_attention",
                        decode.shape_key(heads, kv_heads, head_dim, fp8, new_tokens),
                        decode.bucket_key(batch, context),
                        decode.candidates(batch, kv_heads, context, fp8, new_tokens, sms),
                        run, copies)


def _new_tokens(q: torch.Tensor, kv_heads: int, tables: torch.Tensor, context: int,
                qk_norm: bool, gen: torch.Generator) -> Callable[[int], decode.NewTokens]:
    """The finishing launch's inputs per copy: each row's new k/v go to its last slot."""
    from nanoserve.layers.rotary import rope_cos_sin

    batch, _, head_dim = q.shape
    k = torch.randn(batch, kv_heads, head_dim, generator=gen, device=q.device, dtype=q.dtype)
    v = torch.randn_like(k)
    positions = torch.full((batch,), context - 1, dtype=torch.int64, device=q.device)
    cos_sin = rope_cos_sin(head_dim, context, 1e6, None).to(q.device)
    norms = (torch.ones(head_dim, device=q.device, dtype=q.dtype),) * 2 + (1e-6,) if qk_norm \
        else ()
    last = (context - 1) // BLOCK_SIZE
    slots = [tables[i, :, last].long() * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
             for i in range(tables.shape[0])]
    return lambda i: decode.NewTokens(k, v, positions, slots[i], cos_sin, *norms)


def mla_sweeps(cfg: ModelConfig, tp: int, device: torch.device, batches: Sequence[int],
               contexts: Sequence[int]) -> Iterator[Sweep]:
    """Latent attention's decode split kernel at each batch and context bucket."""
    if cfg.mla is None:
        return
    heads, rank, rope = cfg.num_heads // tp, cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim
    sms = device_sm_count(device)
    for batch, context, blocks in _decode_buckets(cfg, batches, contexts):
        copies = copies_for(batch * blocks * BLOCK_SIZE * (rank + rope) * 2)
        cache = randn(copies * batch * blocks, BLOCK_SIZE, 1, rank + rope, device=device)
        tables = torch.randperm(cache.shape[0], device=device).to(torch.int32).view(
            copies, batch, blocks)
        q_latent = randn(batch, heads, rank, device=device)
        q_rope = randn(batch, heads, rope, device=device)
        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        starts = torch.arange(batch + 1, dtype=torch.int32, device=device)

        def run(config: tuple, i: int, q_latent=q_latent, q_rope=q_rope, cache=cache,
                tables=tables, lens=lens, starts=starts, context=context) -> torch.Tensor:
            return mla_decode.latent_attention(q_latent, q_rope, cache, tables[i], lens,
                                               starts, context, (rank + rope) ** -0.5,
                                               config=config)

        yield Sweep("mla_decode", mla_decode.shape_key(heads, rank, rope),
                    decode.bucket_key(batch, context),
                    mla_decode.candidates(batch, heads, context, sms), run, copies)


def prefill_sweeps(cfg: ModelConfig, tp: int, device: torch.device) -> Iterator[Sweep]:
    """Prefill attention over one chunk of long prompts (its table has one bucket)."""
    if cfg.mla:
        return  # latent attention's prefill is PyTorch's
    heads, kv_heads, head_dim = heads_of(cfg, tp)
    blocks = PREFILL_TOKENS // BLOCK_SIZE
    shape = (PREFILL_SEQS * blocks, BLOCK_SIZE, kv_heads, head_dim)
    k_cache, v_cache = randn(*shape, device=device), randn(*shape, device=device)
    tables = torch.arange(shape[0], dtype=torch.int32, device=device).view(PREFILL_SEQS, blocks)
    q = randn(PREFILL_SEQS * PREFILL_TOKENS, heads, head_dim, device=device)
    lens = [PREFILL_TOKENS] * PREFILL_SEQS
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    starts = torch.arange(0, q.shape[0] + 1, PREFILL_TOKENS, dtype=torch.int32, device=device)
    works: dict[tuple, torch.Tensor] = {}  # planned outside the timed calls, as the runner does

    def run(config: prefill_attention.PrefillConfig, i: int) -> torch.Tensor:
        if config not in works:
            works[config] = prefill_attention.work_on_device(lens, lens, heads, kv_heads, device,
                                                             config)
        return prefill_attention.prefill_attention(q, k_cache, v_cache, tables, seq_lens, starts,
                                                   head_dim ** -0.5, work=works[config],
                                                   config=config)

    yield Sweep("prefill_attention", prefill_attention.shape_key(heads, kv_heads, head_dim),
                "all", prefill_attention.candidates(heads, kv_heads, head_dim), run, 1)


def qk_norm_rope_sweeps(cfg: ModelConfig, tp: int, device: torch.device) -> Iterator[Sweep]:
    """q/k norm + RoPE + KV store per token bucket (q is rotated in place: each call on a
    fresh copy, the same for every candidate)."""
    from nanoserve.layers.rotary import rope_cos_sin

    if cfg.mla:
        return
    heads, kv_heads, head_dim = heads_of(cfg, tp)
    norms = (torch.ones(head_dim, device=device, dtype=torch.bfloat16),) * 2 + (1e-6,) \
        if cfg.qk_norm else ()
    cos_sin = rope_cos_sin(head_dim, 4096, 1e6, None).to(device)
    for tokens in fused_ops.ROW_BUCKETS:
        positions = torch.randint(0, 4096, (tokens,), device=device)
        q = randn(tokens, heads, head_dim, device=device)
        k, v = (randn(tokens, kv_heads, head_dim, device=device) for _ in range(2))
        cache = (tokens + BLOCK_SIZE - 1) // BLOCK_SIZE, BLOCK_SIZE, kv_heads, head_dim
        k_cache, v_cache = randn(*cache, device=device), randn(*cache, device=device)
        slots = torch.arange(tokens, device=device)

        def run(config: tuple, i: int, q=q, k=k, v=v, positions=positions, cos_sin=cos_sin,
                k_cache=k_cache, v_cache=v_cache, slots=slots) -> torch.Tensor:
            return qk_norm_rope.qk_norm_rope_store(positions, q.clone(), k, v, cos_sin, k_cache,
                                                   v_cache, slots, *norms, config=config)

        yield Sweep("qk_norm_rope", qk_norm_rope.shape_key(heads, kv_heads, head_dim),
                    str(tokens), qk_norm_rope.candidates(heads, kv_heads, head_dim), run, 1)
