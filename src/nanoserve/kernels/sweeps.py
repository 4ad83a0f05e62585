"""What ``nanoserve tune`` times besides the GEMV: a :class:`Sweep` is one op's candidate
launches at one shape and bucket, on inputs of the model's real sizes; ``best_launch`` keeps the
fastest whose output matches the heuristic's. Here the MoE, row-wise, sampling and block-fp8
sweeps; attention's are in ``attention_sweeps.py``."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from nanoserve.config import ModelConfig
from nanoserve.kernels import fp8_block_gemm, fused_moe, fused_ops, sampling
from nanoserve.kernels.tuning import BATCH_BUCKETS, bucket

# Bytes the timed inputs span: several times any GPU's L2, so no candidate is timed from cache.
STREAMED_BYTES = 512 << 20
MAX_COPIES = 64
# Tokens a MoE step may route: decode batches up to prefill chunks.
MOE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)
BLOCK_SIZE = 16  # the engine's default block size
Timer = Callable[[Callable[[int], Any], int], float]  # (call(copy), copies) -> µs per call


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


def copies_for(nbytes: int) -> int:
    return max(1, min(MAX_COPIES, STREAMED_BYTES // max(nbytes, 1)))


def heads_of(cfg: ModelConfig, tp: int) -> tuple[int, int, int]:
    return cfg.num_heads // tp, max(1, cfg.num_kv_heads // tp), cfg.head_dim


def randn(*shape: int, device: torch.device, dtype: torch.dtype = torch.bfloat16
           ) -> torch.Tensor:
    return torch.randn(shape, device=device, dtype=dtype)


def moe_sweeps(cfg: ModelConfig, tp: int, device: torch.device) -> Iterator[Sweep]:
    """Each grouped GEMM of the experts (gate_up, down) at each token count, timed as the whole
    fused MoE with the other GEMM on its heuristic's tiles."""
    if not cfg.moe_layers:
        return
    experts, top_k = cfg.num_experts, cfg.num_experts_per_tok
    hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size // tp
    gate_up = randn(experts, 2 * inter, hidden, device=device) * hidden ** -0.5
    down = randn(experts, hidden, inter, device=device) * inter ** -0.5
    for tokens in MOE_TOKENS:
        x = randn(tokens, hidden, device=device)
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
    weight = 1 + 0.1 * randn(width, device=device)
    for rows in fused_ops.ROW_BUCKETS:
        if op == "rms_norm":
            x = randn(rows, width, device=device)
            found = fused_ops.rms_norm_candidates(width)

            def run(config: tuple, i: int, x=x) -> torch.Tensor:
                return fused_ops.rms_norm(x, weight, 1e-6, config)
        else:
            x = randn(rows, 2 * width, device=device)
            found = fused_ops.silu_and_mul_candidates(width)

            def run(config: tuple, i: int, x=x) -> torch.Tensor:
                return fused_ops.silu_and_mul(x, config)
        yield Sweep(op, str(width), str(rows), found, run, 1)


def sampling_sweeps(vocab_size: int, device: torch.device) -> Iterator[Sweep]:
    """The fused sampler per batch bucket: half the rows greedy, half drawn (seeded: every
    launch draws the same tokens)."""
    # On the device: an int seed would be copied there inside the timed graph's capture.
    seed = torch.tensor([1234], dtype=torch.int64, device=device)
    for batch in BATCH_BUCKETS:
        logits = randn(batch, vocab_size, device=device)
        temperature = torch.tensor([0.0, 0.7] * (batch // 2) + [0.7] * (batch % 2),
                                   device=device)

        def run(config: tuple, i: int, logits=logits, temperature=temperature) -> torch.Tensor:
            return sampling.sample_tokens(logits, temperature, seed, config=config)

        yield Sweep("sampling", str(vocab_size), str(batch), sampling.candidates(batch), run, 1)


def fp8_block_sweeps(cfg: ModelConfig, tp: int, device: torch.device,
                     block: tuple[int, int] | None) -> Iterator[Sweep]:
    """The block-fp8 GEMM at each projection the model holds in fp8 and each row bucket (the
    weights cycled through copies, as the GEMV's are)."""
    from nanoserve.kernels.tune import projection_shapes

    if block is None:
        return
    bn, bk = block
    for n, k in {(n, k) for n, k, _ in projection_shapes(cfg, tp).values()}:
        if n % bn or k % bk:
            continue
        copies = copies_for(n * k)
        weights = [randn(n, k, device=device).to(torch.float8_e4m3fn) for _ in range(copies)]
        w_scales = torch.rand(n // bn, k // bk, device=device) * 1e-2
        for rows in fp8_block_gemm.ROW_BUCKETS:
            q = randn(rows, k, device=device).to(torch.float8_e4m3fn)
            x_scales = torch.rand(rows, k // bk, device=device) * 1e-2

            def run(config: tuple, i: int, q=q, x_scales=x_scales, weights=weights,
                    w_scales=w_scales) -> torch.Tensor:
                return fp8_block_gemm.fp8_block_linear(q, x_scales, weights[i], w_scales, block,
                                                       torch.bfloat16, config=config)

            yield Sweep("fp8_block_gemm", fp8_block_gemm.shape_key(n, k, block), str(rows),
                        fp8_block_gemm.candidates(rows, n, block), run, copies)
