"""What ``nanoserve tune`` times for each op besides the GEMV: a :class:`Sweep` is one op's
candidate launches at one shape and bucket, on inputs of the model's real sizes; ``best_launch``
keeps the fastest whose output matches the heuristic's."""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from nanoserve.config import ModelConfig
from nanoserve.kernels import decode_attention as decode
from nanoserve.kernels import (fp8_block_gemm, fused_moe, fused_ops, mla_decode,
                               prefill_attention, qk_norm_rope, sampling)
from nanoserve.kernels.common import device_sm_count
from nanoserve.kernels.tuning import BATCH_BUCKETS, bucket

# Bytes the timed inputs span: several times any GPU's L2, so no candidate is timed from cache.
STREAMED_BYTES = 512 << 20
MAX_COPIES = 64
OPS = ("decode_attention", "mla_decode", "prefill_attention", "fused_moe", "rms_norm",
       "silu_and_mul", "qk_norm_rope", "sampling", "fp8_block_gemm")
# A prefill step's chunk: sequences of new tokens, no cached prefix (a long prompt's first).
PREFILL_SEQS, PREFILL_TOKENS = 4, 2048
# Tokens a MoE step may route: decode batches up to prefill chunks.
MOE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)
BLOCK_SIZE = 16  # the engine's default block size
Timer = Callable[[Callable[[int], Any], int], float]  # (call(copy), copies) -> µs per call
# Decode buckets past this many cached tokens are skipped: no KV cache holds them.
MAX_BATCH_TOKENS = 1 << 21


class Sweep(NamedTuple):
    """One op's candidate launches at one table entry (``op``, ``shape``, ``bucket``)."""

    op: str
    shape: str
    bucket: str
    candidates: Sequence[tuple]  # the first is the heuristic's: the output others must match
    run: Callable[[tuple, int], torch.Tensor]  # (config, input copy) -> the op's output
    copies: int  # input copies a timing cycles through


def best_launch(sweep: Sweep, timer: Timer, atol: float = 2e-2
                ) -> tuple[tuple, dict[tuple, float]]:
    """The fastest candidate whose output matches the heuristic's, and each one's µs."""
    want = sweep.run(sweep.candidates[0], 0).float()
    times = {}
    for config in sweep.candidates:
        got = sweep.run(config, 0).float()
        if not torch.allclose(got, want, atol=atol, rtol=atol):
            continue  # a launch that computes something else is never a winner
        times[config] = timer(lambda i, c=config: sweep.run(c, i), sweep.copies)
    return min(times, key=times.get), times


def op_sweeps(cfg: ModelConfig, tp: int, device: torch.device, ops: Sequence[str],
              batches: Sequence[int], contexts: Sequence[int], fp8_cache: bool = False,
              fp8_block: tuple[int, int] | None = None
              ) -> Iterator[tuple[str, Iterator[Sweep]]]:
    """Each of ``ops`` (in :data:`OPS`' order) with the sweeps of ``cfg``'s shapes, built lazily
    (one bucket's inputs on the device at a time); decode attention over an fp8 cache with
    ``fp8_cache``; the block-fp8 GEMM for weights of ``fp8_block`` scale blocks (none
    without)."""
    builders = {"decode_attention": lambda: decode_sweeps(cfg, tp, device, batches, contexts,
                                                          fp8_cache),
                "mla_decode": lambda: mla_sweeps(cfg, tp, device, batches, contexts),
                "fp8_block_gemm": lambda: fp8_block_sweeps(cfg, tp, device, fp8_block),
                "prefill_attention": lambda: prefill_sweeps(cfg, tp, device),
                "fused_moe": lambda: moe_sweeps(cfg, tp, device),
                "rms_norm": lambda: row_sweeps("rms_norm", cfg.hidden_size, device),
                "silu_and_mul": lambda: row_sweeps("silu_and_mul",
                                                   cfg.intermediate_size // tp, device),
                "qk_norm_rope": lambda: qk_norm_rope_sweeps(cfg, tp, device),
                "sampling": lambda: sampling_sweeps(cfg.vocab_size, device)}
    for op in OPS:
        if op in ops and op in builders:
            yield op, builders[op]()


def copies_for(nbytes: int) -> int:
    return max(1, min(MAX_COPIES, STREAMED_BYTES // max(nbytes, 1)))


def decode_sweeps(cfg: ModelConfig, tp: int, device: torch.device, batches: Sequence[int],
                  contexts: Sequence[int], fp8: bool = False,
                  dtype: torch.dtype = torch.bfloat16) -> Iterator[Sweep]:
    """Decode attention at each batch and context bucket (full contexts: a graph's worst
    case), plain and, for latency-bound batches, finishing the new tokens; over an fp8 cache
    with ``fp8``."""
    heads, kv_heads = cfg.num_heads // tp, max(1, cfg.num_kv_heads // tp)
    head_dim, sms = cfg.head_dim, device_sm_count(device)
    gen = torch.Generator(device=device).manual_seed(0)
    for batch in batches:
        for context in contexts:
            if context > cfg.max_position_embeddings or batch * context > MAX_BATCH_TOKENS:
                continue
            blocks = math.ceil(context / BLOCK_SIZE)
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

                def run(config: decode.DecodeTuning, i: int, new=new) -> torch.Tensor:
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


def _heads(cfg: ModelConfig, tp: int) -> tuple[int, int, int]:
    return cfg.num_heads // tp, max(1, cfg.num_kv_heads // tp), cfg.head_dim


def _randn(*shape: int, device: torch.device, dtype: torch.dtype = torch.bfloat16
           ) -> torch.Tensor:
    return torch.randn(shape, device=device, dtype=dtype)


def prefill_sweeps(cfg: ModelConfig, tp: int, device: torch.device) -> Iterator[Sweep]:
    """Prefill attention over one chunk of long prompts (its table has one bucket)."""
    if cfg.mla:
        return  # latent attention's prefill is PyTorch's
    heads, kv_heads, head_dim = _heads(cfg, tp)
    blocks = PREFILL_TOKENS // BLOCK_SIZE
    shape = (PREFILL_SEQS * blocks, BLOCK_SIZE, kv_heads, head_dim)
    k_cache, v_cache = _randn(*shape, device=device), _randn(*shape, device=device)
    tables = torch.arange(shape[0], dtype=torch.int32, device=device).view(PREFILL_SEQS, blocks)
    q = _randn(PREFILL_SEQS * PREFILL_TOKENS, heads, head_dim, device=device)
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


def moe_sweeps(cfg: ModelConfig, tp: int, device: torch.device) -> Iterator[Sweep]:
    """Each grouped GEMM of the experts (gate_up, down) at each token count, timed as the whole
    fused MoE with the other GEMM on its heuristic's tiles."""
    if not cfg.moe_layers:
        return
    experts, top_k = cfg.num_experts, cfg.num_experts_per_tok
    hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size // tp
    gate_up = _randn(experts, 2 * inter, hidden, device=device) * hidden ** -0.5
    down = _randn(experts, hidden, inter, device=device) * inter ** -0.5
    for tokens in MOE_TOKENS:
        x = _randn(tokens, hidden, device=device)
        routed = torch.rand(tokens, experts, device=device).topk(top_k, dim=1).indices
        weights = torch.full((tokens, top_k), 1 / top_k, device=device, dtype=x.dtype)
        pairs = tokens * top_k
        for which, (n, k) in (("gate_up", (2 * inter, hidden)), ("down", (hidden, inter))):
            def run(config: fused_moe.MoeTiles, i: int, x=x, routed=routed, weights=weights,
                    which=which) -> torch.Tensor:
                return fused_moe.fused_experts(x, gate_up, down, weights, routed,
                                               **{f"{which}_config": config})

            yield Sweep("fused_moe", fused_moe.shape_key(experts, n, k),
                        str(bucket(pairs, fused_moe.PAIR_BUCKETS)),
                        fused_moe.candidates(pairs, experts, n, k), run, 1)


def row_sweeps(op: str, width: int, device: torch.device) -> Iterator[Sweep]:
    """RMSNorm over rows of ``width``, or SiLU-and-mul into rows of ``width``, per row bucket."""
    weight = 1 + 0.1 * _randn(width, device=device)
    for rows in fused_ops.ROW_BUCKETS:
        if op == "rms_norm":
            x = _randn(rows, width, device=device)
            found = fused_ops.rms_norm_candidates(width)

            def run(config: tuple, i: int, x=x) -> torch.Tensor:
                return fused_ops.rms_norm(x, weight, 1e-6, config)
        else:
            x = _randn(rows, 2 * width, device=device)
            found = fused_ops.silu_and_mul_candidates(width)

            def run(config: tuple, i: int, x=x) -> torch.Tensor:
                return fused_ops.silu_and_mul(x, config)
        yield Sweep(op, str(width), str(rows), found, run, 1)


def qk_norm_rope_sweeps(cfg: ModelConfig, tp: int, device: torch.device) -> Iterator[Sweep]:
    """q/k norm + RoPE + KV store per token bucket (q is rotated in place: each call on a
    fresh copy, the same for every candidate)."""
    from nanoserve.layers.rotary import rope_cos_sin

    if cfg.mla:
        return
    heads, kv_heads, head_dim = _heads(cfg, tp)
    norms = (torch.ones(head_dim, device=device, dtype=torch.bfloat16),) * 2 + (1e-6,) \
        if cfg.qk_norm else ()
    for tokens in fused_ops.ROW_BUCKETS:
        positions = torch.randint(0, 4096, (tokens,), device=device)
        cos_sin = rope_cos_sin(head_dim, 4096, 1e6, None).to(device)
        q = _randn(tokens, heads, head_dim, device=device)
        k, v = (_randn(tokens, kv_heads, head_dim, device=device) for _ in range(2))
        cache = (tokens + BLOCK_SIZE - 1) // BLOCK_SIZE, BLOCK_SIZE, kv_heads, head_dim
        k_cache, v_cache = _randn(*cache, device=device), _randn(*cache, device=device)
        slots = torch.arange(tokens, device=device)

        def run(config: tuple, i: int, q=q, k=k, v=v, positions=positions, cos_sin=cos_sin,
                k_cache=k_cache, v_cache=v_cache, slots=slots) -> torch.Tensor:
            return qk_norm_rope.qk_norm_rope_store(positions, q.clone(), k, v, cos_sin, k_cache,
                                                   v_cache, slots, *norms, config=config)

        yield Sweep("qk_norm_rope", qk_norm_rope.shape_key(heads, kv_heads, head_dim),
                    str(tokens), qk_norm_rope.candidates(heads, kv_heads, head_dim), run, 1)


def sampling_sweeps(vocab_size: int, device: torch.device) -> Iterator[Sweep]:
    """The fused sampler per batch bucket: half the rows greedy, half drawn (seeded: every
    launch draws the same tokens)."""
    # On the device: an int seed would be copied there inside the timed graph's capture.
    seed = torch.tensor([1234], dtype=torch.int64, device=device)
    for batch in BATCH_BUCKETS:
        logits = _randn(batch, vocab_size, device=device)
        temperature = torch.tensor([0.0, 0.7] * (batch // 2) + [0.7] * (batch % 2),
                                   device=device)

        def run(config: tuple, i: int, logits=logits, temperature=temperature) -> torch.Tensor:
            return sampling.sample_tokens(logits, temperature, seed, config=config)

        yield Sweep("sampling", str(vocab_size), str(batch), sampling.candidates(batch), run, 1)


def mla_sweeps(cfg: ModelConfig, tp: int, device: torch.device, batches: Sequence[int],
               contexts: Sequence[int]) -> Iterator[Sweep]:
    """Latent attention's decode split kernel at each batch and context bucket."""
    if cfg.mla is None:
        return
    heads, rank, rope = cfg.num_heads // tp, cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim
    sms = device_sm_count(device)
    for batch in batches:
        for context in contexts:
            if context > cfg.max_position_embeddings or batch * context > MAX_BATCH_TOKENS:
                continue
            blocks = math.ceil(context / BLOCK_SIZE)
            copies = copies_for(batch * blocks * BLOCK_SIZE * (rank + rope) * 2)
            cache = _randn(copies * batch * blocks, BLOCK_SIZE, 1, rank + rope, device=device)
            tables = torch.randperm(cache.shape[0], device=device).to(torch.int32).view(
                copies, batch, blocks)
            q_latent = _randn(batch, heads, rank, device=device)
            q_rope = _randn(batch, heads, rope, device=device)
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


def fp8_block_sweeps(cfg: ModelConfig, tp: int, device: torch.device,
                     block: tuple[int, int] | None) -> Iterator[Sweep]:
    """The block-fp8 GEMM at each projection the model holds in fp8 and each row bucket (the
    weights cycled through copies, as the GEMV's are)."""
    from nanoserve.kernels.tune import projection_shapes

    if block is None:
        return
    bn, bk = block
    for n, k, _ in {(n, k, None) for n, k, _ in projection_shapes(cfg, tp).values()}:
        if n % bn or k % bk:
            continue
        copies = copies_for(n * k)
        weights = [_randn(n, k, device=device).to(torch.float8_e4m3fn) for _ in range(copies)]
        w_scales = torch.rand(n // bn, k // bk, device=device) * 1e-2
        for rows in fp8_block_gemm.ROW_BUCKETS:
            q = _randn(rows, k, device=device).to(torch.float8_e4m3fn)
            x_scales = torch.rand(rows, k // bk, device=device) * 1e-2

            def run(config: tuple, i: int, q=q, x_scales=x_scales) -> torch.Tensor:
                return fp8_block_gemm.fp8_block_linear(q, x_scales, weights[i], w_scales, block,
                                                       torch.bfloat16, config=config)

            yield Sweep("fp8_block_gemm", fp8_block_gemm.shape_key(n, k, block), str(rows),
                        fp8_block_gemm.candidates(rows, n, block), run, copies)
