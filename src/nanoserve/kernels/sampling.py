"""Fused greedy / temperature sampling: inverse-transform sampling over per-tile softmax sums.

Two launches read the logits once (docs/kernels.md): (row, chunk) programs store per tile the
largest score ``s = x log2(e) / T`` and the sum of ``2^(s - max)`` (greedy rows: the argmax);
then per row, the tile where the running weight passes ``u`` times the total is reread for the
token. ``u`` is Philox keyed by a seed in device memory: a CUDA graph draws anew as it changes.
Launch options: :func:`select` (the tuning file ``configs/sampling/<device>.json``, keyed by the
vocabulary size and bucketed by batch rows, else :func:`heuristic_config`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanoserve.kernels.common import LOG2E, interpreted
from nanoserve.kernels.tuning import BATCH_BUCKETS, bucket, load_table, memoised, tuned

# Tiles per program: few at small batches, spread over the SMs, more at large (tiles_per_chunk).
TILE = 2048
TILES_PER_CHUNK = 2
MAX_TILES_PER_CHUNK = 16
NUM_WARPS = 4
# Small tiles on CPU so that short test rows still span several tiles and chunks.
INTERPRETER_TILE = 32


class SamplingConfig(NamedTuple):
    """Launch options shared by a draw's two kernels: the first's chunks and the second's
    reread tile are of the same tiles, so one config serves both."""

    tile: int = TILE  # logits a tile: a power of two
    tiles_per_chunk: int = TILES_PER_CHUNK  # tiles a first-kernel program
    num_warps: int = NUM_WARPS
_LOG2E = tl.constexpr(LOG2E)
# Scores clamp at float32's max (inf logits, tiny temperatures) so that score - max is defined.
_MAX_SCORE = tl.constexpr(3.4028234663852886e38)
_NO_INDEX = tl.constexpr(2 ** 31 - 1)  # loses every lowest-index tie


@triton.jit
def _raw_tile(row_ptr, cols, limit):
    """One tile of a row as float32, -inf from column ``limit`` on (the vocabulary's end, or 0
    to load nothing)."""
    return tl.load(row_ptr + cols, mask=cols < limit, other=float("-inf")).to(tl.float32)


@triton.jit
def _no_nan(x):
    """NaN as -inf: never drawn."""
    return tl.where(x == x, x, float("-inf"))


@triton.jit
def _logits_tile(row_ptr, cols, limit):
    return _no_nan(_raw_tile(row_ptr, cols, limit))


@triton.jit
def _allowed_only(x, bits_row_ptr, cols, limit, masked):
    """``x`` with -inf where the row's grammar bitmask (token t: bit t % 32 of word t // 32)
    forbids the token; rows without a mask (``masked`` false) read no bits."""
    words = tl.load(bits_row_ptr + cols // 32, mask=cols < tl.where(masked, limit, 0), other=-1)
    return tl.where(((words >> (cols % 32)) & 1) != 0, x, float("-inf"))


@triton.jit
def _bits_row(bits_ptr, mask_row_ptr, row, stride_bits):
    """The row's bitmask words and whether it has one (its index among the masked rows >= 0)."""
    index = tl.load(mask_row_ptr + row)
    return bits_ptr + tl.maximum(index, 0).to(tl.int64) * stride_bits, index >= 0


@triton.jit
def _num_unusable(x):
    """How many of a tile's raw logits are NaN or +inf (they make the row's sample void)."""
    return tl.sum(tl.where(x < float("inf"), 0, 1), axis=0)


@triton.jit
def _scores(x, temperature):
    """``x / T`` in base 2: exp2 of a score difference is a probability ratio."""
    return tl.minimum(x * (_LOG2E / temperature), _MAX_SCORE)


@triton.jit
def _finite(top):
    """A tile's or row's maximum to subtract: 0 when nothing is finite (every weight is 0)."""
    return tl.where(top == float("-inf"), 0.0, top)


@triton.jit
def _tile_stats_kernel(
    logits_ptr, temperature_ptr, tile_max_ptr, tile_sum_ptr, tile_arg_ptr, seed_ptr, unusable_ptr,
    bits_ptr, mask_row_ptr, vocab_size, stride_row, stride_bits, num_tiles, TILE: tl.constexpr,
    TILES_PER_CHUNK: tl.constexpr, CHECK: tl.constexpr, HAS_MASK: tl.constexpr,
):
    if tl.load(seed_ptr) < 0:
        return
    row = tl.program_id(0)
    first = tl.program_id(1) * TILES_PER_CHUNK
    temperature = tl.load(temperature_ptr + row)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    stats = row.to(tl.int64) * num_tiles
    offsets = tl.arange(0, TILE)
    if HAS_MASK:
        bits_row, masked = _bits_row(bits_ptr, mask_row_ptr, row, stride_bits)
    # The last chunk stops at the vocabulary; each loop loads the next tile before reducing one.
    end = tl.minimum(first + TILES_PER_CHUNK, num_tiles)
    x = _raw_tile(row_ptr, first * TILE + offsets, vocab_size)
    if HAS_MASK:
        x = _allowed_only(x, bits_row, first * TILE + offsets, vocab_size, masked)
    unusable = 0
    if temperature > 0.0:
        for tile in range(first, end):
            after = _raw_tile(row_ptr, (tile + 1) * TILE + offsets,
                              tl.where(tile + 1 < end, vocab_size, 0))
            if HAS_MASK:
                after = _allowed_only(after, bits_row, (tile + 1) * TILE + offsets, vocab_size,
                                      masked)
            if CHECK:
                unusable += _num_unusable(x)
            x = _no_nan(x)
            s = _scores(x, temperature)
            top = tl.max(s, axis=0)
            tl.store(tile_sum_ptr + stats + tile, tl.sum(tl.exp2(s - _finite(top)), axis=0))
            tl.store(tile_max_ptr + stats + tile, top)
            x = after
    else:
        # Greedy: each position keeps its (max, index) over the chunk, reduced once into the
        # chunk's first slot; the other slots hold -inf and no index, never picked.
        best = tl.full([TILE], float("-inf"), tl.float32)
        # An all -inf chunk reports its first index, so an all -inf row yields token 0.
        best_idx = first * TILE + offsets
        for tile in range(first, end):
            after = _raw_tile(row_ptr, (tile + 1) * TILE + offsets,
                              tl.where(tile + 1 < end, vocab_size, 0))
            if HAS_MASK:
                after = _allowed_only(after, bits_row, (tile + 1) * TILE + offsets, vocab_size,
                                      masked)
            if CHECK:
                unusable += _num_unusable(x)
            x = _no_nan(x)
            # Strictly greater: a position sees increasing indices, so it keeps the first.
            better = x > best
            best = tl.where(better, x, best)
            best_idx = tl.where(better, tile * TILE + offsets, best_idx)
            if tile > first:
                tl.store(tile_max_ptr + stats + tile, float("-inf"))
                tl.store(tile_arg_ptr + stats + tile, _NO_INDEX)
            x = after
        top = tl.max(best, axis=0)
        tl.store(tile_max_ptr + stats + first, top)
        tl.store(tile_arg_ptr + stats + first,
                 tl.min(tl.where(best == top, best_idx, _NO_INDEX), axis=0))
    if CHECK:
        tl.store(unusable_ptr + row.to(tl.int64) * tl.num_programs(1) + tl.program_id(1),
                 unusable)


@triton.jit
def _pick_kernel(
    logits_ptr, temperature_ptr, tile_max_ptr, tile_sum_ptr, tile_arg_ptr, seed_ptr, unusable_ptr,
    bits_ptr, mask_row_ptr, out_ptr, checked_ptr, vocab_size, stride_row, stride_bits, num_tiles,
    num_chunks, TILE: tl.constexpr, BLOCK_T: tl.constexpr, CHECK: tl.constexpr,
    BLOCK_C: tl.constexpr, VOID: tl.constexpr, HAS_MASK: tl.constexpr,
):
    seed = tl.load(seed_ptr)
    if seed < 0:
        return
    row = tl.program_id(0)
    temperature = tl.load(temperature_ptr + row)
    tiles = tl.arange(0, BLOCK_T)
    in_row = tiles < num_tiles
    stats = row.to(tl.int64) * num_tiles + tiles
    # All three loads before any use: one round trip (unwritten stats go unused).
    tops = tl.load(tile_max_ptr + stats, mask=in_row, other=float("-inf"))
    sums = tl.load(tile_sum_ptr + stats, mask=in_row, other=0.0)
    args = tl.load(tile_arg_ptr + stats, mask=in_row, other=_NO_INDEX)
    row_top = tl.max(tops, axis=0)
    if temperature > 0.0:
        weights = sums.to(tl.float64) * tl.exp2(tops - _finite(row_top)).to(tl.float64)
        running = tl.cumsum(weights, axis=0)
        total = tl.max(running, axis=0)  # the last running weight: weights are >= 0
        r0, r1, _, _ = tl.philox(seed.to(tl.uint64), row, 0, 0, 0)
        # 53 random bits: u = k / 2^53 in [0, 1), exact in float64.
        u = ((r0 >> 11).to(tl.float64) * 4294967296.0 + r1.to(tl.float64)) * (2.0 ** -53)
        target = u * total
        tile = tl.min(tl.where(running > target, tiles, BLOCK_T), axis=0)
        # u * total can round up to the total: then the last tile with weight.
        last = tl.max(tl.where(weights > 0.0, tiles, -1), axis=0)
        # Nothing finite in the row: tile 0, whose masses are all 0, and token 0 below.
        tile = tl.maximum(tl.where(tile == BLOCK_T, last, tile), 0)
        here = tiles == tile
        weight = tl.sum(tl.where(here, weights, 0.0), axis=0)
        # Where u falls inside the tile, in the tile's own units (its sum of 2^(s - max)).
        inside = (target - tl.sum(tl.where(here, running, 0.0), axis=0) + weight) \
            / tl.where(weight > 0.0, weight, 1.0) \
            * tl.sum(tl.where(here, sums, 0.0), axis=0).to(tl.float64)
        cols = tile * TILE + tl.arange(0, TILE)
        x = _logits_tile(logits_ptr + row.to(tl.int64) * stride_row, cols, vocab_size)
        if HAS_MASK:
            bits_row, masked = _bits_row(bits_ptr, mask_row_ptr, row, stride_bits)
            x = _allowed_only(x, bits_row, cols, vocab_size, masked)
        tile_top = tl.max(tl.where(here, tops, float("-inf")), axis=0)
        mass = tl.exp2(_scores(x, temperature) - _finite(tile_top))
        token = tl.min(tl.where(tl.cumsum(mass.to(tl.float64), axis=0) > inside, cols,
                                _NO_INDEX), axis=0)
        # The tile's sum in this order can fall a rounding short of the first pass's.
        fallback = tl.maximum(tl.max(tl.where(mass > 0.0, cols, -1), axis=0), 0)
        token = tl.where(token == _NO_INDEX, fallback, token)
    else:
        # Tiles cover increasing index ranges: the lowest index among the row's maxima.
        token = tl.min(tl.where(tops == row_top, args, _NO_INDEX), axis=0)
    tl.store(out_ptr + row, token.to(tl.int64))
    if CHECK:
        chunks = tl.arange(0, BLOCK_C)
        bad = tl.sum(tl.load(unusable_ptr + row.to(tl.int64) * num_chunks + chunks,
                             mask=chunks < num_chunks, other=0), axis=0)
        # NaN or +inf somewhere, or nothing finite (an all -inf row's max stays -inf).
        void = (bad > 0) | (row_top == float("-inf"))
        tl.store(checked_ptr + row, tl.where(void, VOID, token.to(tl.int64)))


def tiles_per_chunk(batch: int) -> int:
    """Tiles per program: 2 up to 16 rows, doubling with the batch up to 16 tiles from 65 rows.
    Tiles' results do not depend on which program computes them, so neither do the tokens."""
    return min(MAX_TILES_PER_CHUNK, max(TILES_PER_CHUNK, triton.next_power_of_2(batch) // 8))


def heuristic_config(batch: int) -> SamplingConfig:
    """The launch for a vocabulary nobody tuned: :data:`TILE`, :func:`tiles_per_chunk`."""
    return SamplingConfig(TILE, tiles_per_chunk(batch), NUM_WARPS)


def from_table(table: dict, batch: int, vocab_size: int) -> SamplingConfig:
    """:func:`select`'s rule over one tuning table (``{"V": {"batch bucket": entry}}``)."""
    return tuned(table, str(vocab_size), bucket(batch, BATCH_BUCKETS), heuristic_config(batch))


@memoised
def select(batch: int, vocab_size: int, device: torch.device) -> SamplingConfig:
    """The launch for ``batch`` rows of ``vocab_size`` logits: the device's tuning file's entry,
    else the heuristic's; under the interpreter the heuristic's on :data:`INTERPRETER_TILE`."""
    if interpreted(device):
        return heuristic_config(batch)._replace(tile=INTERPRETER_TILE)
    return from_table(load_table("sampling", device), batch, vocab_size)


def candidates(batch: int) -> list[SamplingConfig]:
    """Launches worth timing for ``batch`` rows, the heuristic's first: other tiles and warps
    over the heuristic's chunk of logits a program, then half and twice its chunk."""
    default = heuristic_config(batch)
    span = default.tile * default.tiles_per_chunk
    return list(dict.fromkeys([
        default,
        *(SamplingConfig(tile, max(1, span // tile), warps)
          for tile in (1024, 2048, 4096) for warps in (4, 8)),
        *(default._replace(tiles_per_chunk=width)
          for width in (default.tiles_per_chunk // 2, 2 * default.tiles_per_chunk) if width)]))


def compile_for_batches(max_batch: int, vocab_size: int, dtype: torch.dtype,
                        device: torch.device) -> None:
    """Compile the kernels for each launch (:func:`select`) of batches up to ``max_batch`` rows,
    up front, with and without a grammar's bitmask (a compile in the middle of a run stalls its
    batch). ``sample_tokens`` selects the same launch for each batch compiled."""
    first_batch: dict[SamplingConfig, int] = {}
    for batch in range(1, max_batch + 1):
        first_batch.setdefault(select(batch, vocab_size, device), batch)
    bits = torch.full((1, triton.cdiv(vocab_size, 32)), -1, dtype=torch.int32, device=device)
    rows = torch.zeros(1, dtype=torch.int64, device=device)
    for batch in first_batch.values():
        for bitmask in (None, (rows, bits)):
            sample_tokens(torch.zeros(batch, vocab_size, dtype=dtype, device=device),
                          torch.ones(batch, device=device), seed=0, bitmask=bitmask)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor,
                  seed: int | torch.Tensor, out: torch.Tensor | None = None,
                  checked_out: torch.Tensor | None = None, void_id: int = -1,
                  bitmask: tuple[torch.Tensor | None, torch.Tensor] | None = None,
                  mask_rows: torch.Tensor | None = None,
                  config: SamplingConfig | None = None) -> torch.Tensor:
    """Draw one token per row of ``logits [B, V]``: ``[B]`` int64 token ids (into ``out`` if given).
    With ``checked_out`` ([B] int64), the same ids go there too, ``void_id`` in rows with a NaN or
    +inf logit or none finite (the rows ``runner.sampler.mark_failed_rows`` marks).

    A row with ``temperature`` 0 (``[B]`` float32) takes the argmax (lowest index on ties);
    others draw ``softmax(logits / T)``, from ``seed``: an int in ``[0, 2**62)`` or a one-element
    int64 device tensor read when the kernel runs (negative: nothing drawn, ``out`` untouched).
    A -inf logit is drawn only if the whole row is -inf (token 0); NaN is never picked.
    ``bitmask`` (rows ``[R]`` int64, bits ``[R, ceil(V / 32)]`` int32, as
    ``runner.sampler.apply_bitmask`` takes it): those rows draw only the tokens whose bit is 1,
    read inside the kernels (the same tokens as sampling the masked logits). ``mask_rows``
    (``[B]`` int32, each row's index among the bitmask's rows, -1 for none) may replace
    ``rows`` (then None), saving the launches that derive it. ``config``: both kernels' launch
    (default: :func:`select`'s)."""
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
    config = config or select(batch, vocab_size, logits.device)
    num_tiles = triton.cdiv(vocab_size, config.tile)
    tile_max = torch.empty(batch, num_tiles, dtype=torch.float32, device=logits.device)
    tile_sum = torch.empty_like(tile_max)
    tile_arg = torch.empty(batch, num_tiles, dtype=torch.int32, device=logits.device)
    num_chunks = triton.cdiv(num_tiles, config.tiles_per_chunk)
    check = checked_out is not None
    if check:
        assert checked_out.shape == (batch,) and checked_out.dtype == torch.int64
    unusable = torch.empty(batch, num_chunks, dtype=torch.int32, device=logits.device) \
        if check else tile_arg
    bits, mask_row = tile_arg, tile_arg  # unread without a mask
    if bitmask is not None:
        rows, bits = bitmask
        assert bits.dtype == torch.int32 and bits.stride(-1) == 1 \
            and bits.shape[1] == triton.cdiv(vocab_size, 32) \
            and (rows is None or bits.shape[0] == rows.shape[0]), \
            "bitmask bits must be int32 [R, ceil(V / 32)] with contiguous rows"
        if mask_rows is not None:
            assert mask_rows.shape == (batch,) and mask_rows.dtype == torch.int32
            mask_row = mask_rows
        else:
            mask_row = torch.full((batch,), -1, dtype=torch.int32, device=logits.device)
            mask_row[rows] = torch.arange(rows.shape[0], dtype=torch.int32,
                                          device=logits.device)
    common = (logits, temperature, tile_max, tile_sum, tile_arg, seed, unusable, bits, mask_row)
    _tile_stats_kernel[(batch, num_chunks)](
        *common, vocab_size, logits.stride(0), bits.stride(0), num_tiles, TILE=config.tile,
        TILES_PER_CHUNK=config.tiles_per_chunk, CHECK=check, HAS_MASK=bitmask is not None,
        num_warps=config.num_warps,
    )
    _pick_kernel[(batch,)](
        *common, token_ids, checked_out if check else token_ids, vocab_size, logits.stride(0),
        bits.stride(0), num_tiles, num_chunks, TILE=config.tile,
        BLOCK_T=triton.next_power_of_2(num_tiles), CHECK=check,
        BLOCK_C=triton.next_power_of_2(num_chunks), VOID=void_id, HAS_MASK=bitmask is not None,
        num_warps=config.num_warps,
    )
    return token_ids
