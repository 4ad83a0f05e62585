"""Fused greedy / temperature sampling: one pass over the logits with the Gumbel-max trick.

``argmax_i(logits_i / T + G_i)`` with ``G_i = -log(E_i)``, ``E_i ~ Exp(1)``, is token ``i`` with
probability ``softmax(logits / T)_i``: it is the sampler's exponential race ``argmax_i p_i / E_i``
taken in log space, so neither the softmax nor its normalisation is ever materialised. The noise
comes from Triton's counter-based Philox generator (``tl.philox``), keyed by a seed read from
device memory and counted by (row, position), so a step reads the logits once, in their own
dtype, and writes nothing but small per-chunk partial results. Rows with temperature 0 skip the
noise: a plain argmax.

Two launches: (row, vocabulary chunk) programs reduce each chunk to its (max, argmax), so that
batch 1 still spreads over many SMs; then one program per row reduces its chunks. Launch shapes
depend on tensor shapes alone and the seed is read on the device, so nothing waits on the device
and a CUDA graph that captured the launches draws new noise whenever its seed tensor changes. A
negative seed draws nothing: a decode graph's batch that needs the general sampler skips the pass.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from nanoserve.kernels.common import LOG2E, interpreted

# A chunk is some tiles of 4 * QUARTER logits: one Philox call yields 4 numbers, one for each
# logit of a group of 4 adjacent ones. Small batches take TILES_PER_CHUNK tiles (4096 logits, 38
# programs per row of a 152k vocabulary, so batch 1 spreads over the SMs); larger ones take up
# to MAX_TILES_PER_CHUNK, so each program has more than two tiles to stream
# (tiles_per_chunk).
QUARTER = 512
TILES_PER_CHUNK = 2
MAX_TILES_PER_CHUNK = 16
NUM_WARPS = 4
# Small tiles on CPU so that short test rows still span several tiles and chunks.
INTERPRETER_QUARTER = 8
# -log(u) at the largest u, 1 - 2^-24, is ~2^-24: an approximate (fast-math) log could round it
# to 0 or below and make the noise infinite. Torch's exponential_ guards the same way.
E_MIN = tl.constexpr(2.0 ** -26)
_LOG2E = tl.constexpr(LOG2E)
_INT32_MAX = 2 ** 31 - 1
_NO_INDEX = tl.constexpr(_INT32_MAX)  # loses every lowest-index tie


@triton.jit
def _log2(x, FAST: tl.constexpr):
    """log2; on the GPU the one-instruction approximation (the interpreter has only the exact
    one)."""
    if FAST:
        return libdevice.fast_log2f(x)
    return tl.log2(x)


@triton.jit
def _chunk_argmax_kernel(
    logits_ptr, temperature_ptr, best_val_ptr, best_idx_ptr, seed_ptr, vocab_size, stride_row,
    QUARTER: tl.constexpr, TILES_PER_CHUNK: tl.constexpr, FAST_LOG: tl.constexpr,
):
    seed = tl.load(seed_ptr)
    if seed < 0:
        return
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    seed = seed.to(tl.uint64)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    # A tile is [QUARTER, 4]: row g holds the group of logits 4g .. 4g+3 and their 4 numbers, so
    # each thread draws once for the adjacent logits it loads.
    groups = tl.arange(0, QUARTER)[:, None]
    k = tl.arange(0, 4)[None, :]
    first = chunk * (TILES_PER_CHUNK * 4 * QUARTER)
    # Philox counter (group index in the row, row, 0, 0): every logit of the batch gets its own
    # number, whatever the other rows' temperatures.
    group = first // 4 + groups
    best = tl.full([QUARTER, 4], float("-inf"), tl.float32)
    # A chunk with no finite logit reports its first index, so an all -inf row yields token 0.
    best_idx = first + 4 * groups + k
    # The last chunk skips the tiles that lie wholly past the vocabulary.
    for t in range(tl.minimum(TILES_PER_CHUNK, tl.cdiv(vocab_size - first, 4 * QUARTER))):
        cols = first + t * (4 * QUARTER) + 4 * groups + k
        x = tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
        if temperature > 0.0:
            r0, r1, r2, r3 = tl.philox(seed, group + t * QUARTER, row, 0, 0)
            bits = tl.where(k == 0, r0, tl.where(k == 1, r1, tl.where(k == 2, r2, r3)))
            # The top 23 bits as (n + 1/2) / 2^23: uniform in (0, 1), never 0 or 1, exact in fp32.
            u = ((bits >> 9).to(tl.float32) + 0.5) * (2.0 ** -23)
            exponential = tl.maximum(-tl.log(u), E_MIN)  # ~ Exp(1)
            # x / T - ln(E), times log2(e) (the same argmax): x * log2(e) / T - log2(E). The
            # second log may be approximate (absolute error ~2^-22 against scores of order 1
            # and more); the first may not: near u = 1 it must resolve -ln(u) ~ 2^-24.
            x = x * (_LOG2E / temperature) - _log2(exponential, FAST_LOG)
        # Strictly greater: a position sees increasing indices, so it keeps the first of equals.
        better = x > best
        best = tl.where(better, x, best)
        best_idx = tl.where(better, cols, best_idx)
    top = tl.max(best, axis=None)
    token = tl.min(tl.where(best == top, best_idx, _NO_INDEX), axis=None)
    num_chunks = tl.num_programs(1)
    out = row.to(tl.int64) * num_chunks + chunk
    tl.store(best_val_ptr + out, top)
    tl.store(best_idx_ptr + out, token)


@triton.jit
def _row_argmax_kernel(best_val_ptr, best_idx_ptr, out_ptr, seed_ptr, num_chunks,
                       BLOCK_C: tl.constexpr):
    if tl.load(seed_ptr) < 0:
        return
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    mask = c < num_chunks
    vals = tl.load(best_val_ptr + row * num_chunks + c, mask=mask, other=float("-inf"))
    idx = tl.load(best_idx_ptr + row * num_chunks + c, mask=mask, other=_NO_INDEX)
    # Chunks cover increasing index ranges: the lowest index among equal maxima is the first.
    token = tl.min(tl.where(vals == tl.max(vals, 0), idx, _NO_INDEX), 0)
    tl.store(out_ptr + row, token.to(tl.int64))


def tiles_per_chunk(batch: int) -> int:
    """Tiles per program: 2 up to 16 rows, doubling with the batch up to 16 tiles from 65 rows
    (five programs per row of a 152k vocabulary: 1,280 at 256 rows). The noise is keyed by
    position, not by chunk, so the tokens do not depend on it."""
    return min(MAX_TILES_PER_CHUNK, max(TILES_PER_CHUNK, triton.next_power_of_2(batch) // 8))


def compile_for_batches(max_batch: int, vocab_size: int, dtype: torch.dtype,
                        device: torch.device) -> None:
    """Run the kernels once per chunk width that batches of up to ``max_batch`` rows take, so
    that none of them compiles in the middle of serving."""
    first_batch: dict[int, int] = {}
    for batch in range(1, max_batch + 1):
        first_batch.setdefault(tiles_per_chunk(batch), batch)
    for batch in first_batch.values():
        gumbel_max_sample(torch.zeros(batch, vocab_size, dtype=dtype, device=device),
                          torch.ones(batch, device=device), seed=0)


def gumbel_max_sample(logits: torch.Tensor, temperature: torch.Tensor,
                      seed: int | torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one token per row of ``logits [B, V]``; returns ``[B]`` int64 token ids (``out``
    when given).

    A row with ``temperature`` 0 (``[B]`` float32) takes the argmax of its logits, the lowest
    index on ties as ``torch.argmax``. Any other row draws token ``i`` with probability
    ``softmax(logits / T)_i``, by the Gumbel-max trick with noise from ``seed``: an int in
    ``[0, 2**62)``, or a one-element int64 tensor on the logits' device holding one, read when
    the kernel runs; a negative value there draws nothing and leaves the result as it was. The same
    seed and inputs give the same tokens (on the same kind of device; the CPU interpreter tiles
    differently). A token whose logit is -inf is never drawn, unless
    the whole row is -inf, which yields token 0. NaN logits are never picked (``torch.argmax``
    would pick them).

    ``logits`` may be bf16, fp16 or fp32 with any row stride, but a contiguous last dimension.
    Works on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1``.
    """
    batch, vocab_size = logits.shape
    assert logits.stride(-1) == 1, "the vocabulary dimension must be contiguous"
    assert temperature.shape == (batch,) and temperature.dtype == torch.float32 \
        and temperature.is_contiguous(), "temperature must be a contiguous float32 [B]"
    if isinstance(seed, int):
        assert 0 <= seed < 2 ** 62, "seed must be a 62-bit non-negative int"
        seed = torch.tensor([seed], dtype=torch.int64, device=logits.device)
    assert seed.shape == (1,) and seed.dtype == torch.int64 and seed.device == logits.device, \
        "a seed tensor must be one int64 on the logits' device"
    token_ids = torch.empty(batch, dtype=torch.int64, device=logits.device) if out is None else out
    assert token_ids.shape == (batch,) and token_ids.dtype == torch.int64
    if batch == 0:
        return token_ids
    quarter = INTERPRETER_QUARTER if interpreted(logits.device) else QUARTER
    tiles = tiles_per_chunk(batch)
    num_chunks = triton.cdiv(vocab_size, tiles * 4 * quarter)
    best_val = torch.empty(batch, num_chunks, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(batch, num_chunks, dtype=torch.int32, device=logits.device)
    _chunk_argmax_kernel[(batch, num_chunks)](
        logits, temperature, best_val, best_idx, seed, vocab_size, logits.stride(0),
        QUARTER=quarter, TILES_PER_CHUNK=tiles, FAST_LOG=not interpreted(logits.device),
        num_warps=NUM_WARPS,
    )
    _row_argmax_kernel[(batch,)](
        best_val, best_idx, token_ids, seed, num_chunks,
        BLOCK_C=triton.next_power_of_2(num_chunks), num_warps=1,
    )
    return token_ids
