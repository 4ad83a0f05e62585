"""The experts of a mixture-of-experts MLP on the GPU: two grouped GEMMs, no host sync.

The routing stays on the device (vLLM's design), so the chain is CUDA-graph capturable:
``group_by_expert`` groups the (token, slot) pairs by expert in blocks of ``block_m`` rows, in one
launch of fixed shape; ``_moe_gemm_kernel`` multiplies each block by its expert's weights; each
token's ``top_k`` results are summed. Every kernel waits (PDL) first thing: all its inputs come
from the kernels before it. Each GEMM's tiles are data: :func:`select` (``configs/fused_moe/``,
keyed by the GEMM's shape as vLLM's fused-MoE configs are).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanoserve.kernels.common import dot_precision, interpreted, programmatic_launch
from nanoserve.kernels.fused_ops import silu_and_mul
from nanoserve.kernels.tuning import bucket, load_table, memoised, tuned


class ExpertBlocks(NamedTuple):
    """The routing's pairs grouped by expert: ``pair_ids`` holds each row's ``token * top_k + slot``
    (``num_pairs``: padding), ``block_expert`` each block's expert (-1: unused, at the end)."""

    pair_ids: torch.Tensor
    block_expert: torch.Tensor
    block_m: int
    num_pairs: int


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks enough for any routing: each used expert may leave one block partly empty."""
    return triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


GROUP_CHUNK = 1024  # pairs the grouping kernel reads at a time


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _group_by_expert_kernel(
    experts_ptr, pair_ids_ptr, block_expert_ptr, next_row_ptr,
    num_pairs, num_blocks,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: count each expert's pairs, lay out the padded blocks, then give each pair
    the next free row of its expert's group by atomics (whose order changes no result)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    p = tl.arange(0, BLOCK_P)
    e = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for chunk in range(0, num_pairs, BLOCK_P):
        valid = chunk + p < num_pairs
        expert = tl.load(experts_ptr + chunk + p, mask=valid, other=0).to(tl.int32)
        counts += tl.histogram(expert, BLOCK_E, mask=valid)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    total = tl.sum(padded, 0)
    # A block's expert: how many experts' padded groups end at or before the block's start
    # (experts past the last, BLOCK_E's padding, end at the total: never before a used block).
    for first in range(0, num_blocks, BLOCK_B):
        b = first + tl.arange(0, BLOCK_B)
        ended = padded_end[None, :] <= (b * BLOCK_M)[:, None]
        expert_of = tl.sum(ended.to(tl.int32), 1)
        tl.store(block_expert_ptr + b, tl.where(b * BLOCK_M < total, expert_of, -1),
                 mask=b < num_blocks)
    for first in range(0, num_blocks * BLOCK_M, BLOCK_P):  # every row padding until placed
        tl.store(pair_ids_ptr + first + p, num_pairs, mask=first + p < num_blocks * BLOCK_M)
    # Atomically, like the increments after it, so that all of them act on the L2's copy.
    tl.atomic_xchg(next_row_ptr + e, padded_end - padded, sem="relaxed")
    tl.debug_barrier()  # the offsets and the padding fill, before any pair is placed
    for chunk in range(0, num_pairs, BLOCK_P):
        valid = chunk + p < num_pairs
        expert = tl.load(experts_ptr + chunk + p, mask=valid, other=0).to(tl.int32)
        row = tl.atomic_add(next_row_ptr + expert, 1, mask=valid, sem="relaxed")
        tl.store(pair_ids_ptr + row, chunk + p, mask=valid)


def group_by_expert(experts: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Group the pairs of ``experts`` (``[T, top_k]`` expert indices) by expert, in one launch."""
    flat = experts.reshape(-1)
    num_pairs = flat.numel()
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    device = experts.device
    pair_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    block_e = triton.next_power_of_2(num_experts)
    next_row = torch.empty(block_e, dtype=torch.int32, device=device)
    small = interpreted(device)  # small chunks: the tests' routings cross chunk edges
    pdl = programmatic_launch(device)
    _group_by_expert_kernel[(1,)](
        flat, pair_ids, block_expert, next_row, num_pairs, num_blocks,
        BLOCK_M=block_m, BLOCK_P=8 if small else GROUP_CHUNK, BLOCK_E=block_e,
        BLOCK_B=16 if small else 64, PDL=pdl, num_warps=4, launch_pdl=pdl,
    )
    return ExpertBlocks(pair_ids, block_expert, block_m, num_pairs)


class MoeTiles(NamedTuple):
    """Tiles and launch options of one grouped GEMM. The pairs must be grouped by
    ``block_m`` (:func:`group_by_expert`): a program multiplies one block of rows."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


INTERPRETER_TILES = MoeTiles(16, 16, 32, 1, 1)
# Tuning-table buckets of (token, slot) pairs: a batch's tokens times top_k.
PAIR_BUCKETS = tuple(2 ** i for i in range(17))  # 1 .. 65536


def shape_key(num_experts: int, n: int, k: int) -> str:
    """A tuning table's key: one grouped GEMM's experts and their ``[N, K]`` weights."""
    return f"E={num_experts},N={n},K={k}"


def heuristic_config(num_pairs: int, num_experts: int) -> MoeTiles:
    """Tiles for a shape nobody tuned: taller blocks as experts get more pairs, 16 rows
    (``tl.dot``'s least) to 128."""
    per_expert = num_pairs / num_experts
    if per_expert <= 4:
        return MoeTiles(16, 64, 128, 4, 4)
    if per_expert <= 16:
        return MoeTiles(32, 64, 128, 4, 4)
    if per_expert <= 64:
        return MoeTiles(64, 128, 64, 8, 3)
    return MoeTiles(128, 128, 64, 8, 3)


def from_table(table: dict, num_pairs: int, num_experts: int, n: int, k: int) -> MoeTiles:
    """:func:`select`'s rule over one tuning table (``{shape_key: {pair bucket: entry}}``)."""
    return tuned(table, shape_key(num_experts, n, k), bucket(num_pairs, PAIR_BUCKETS),
                 heuristic_config(num_pairs, num_experts))


@memoised
def select(num_pairs: int, num_experts: int, n: int, k: int, device: torch.device) -> MoeTiles:
    """The tiles of a grouped GEMM of ``num_pairs`` pairs by ``num_experts`` experts' ``[n, k]``
    weights: the device's tuning file's entry for the shape and pair bucket, else the
    heuristic's."""
    if interpreted(device):
        return INTERPRETER_TILES
    return from_table(load_table("fused_moe", device), num_pairs, num_experts, n, k)


# Tiles beside the block height that are worth timing: (block_n, block_k, warps, stages).
CANDIDATE_TILES = ((64, 128, 4, 4), (128, 64, 8, 3), (64, 64, 4, 3), (32, 128, 4, 4),
                   (128, 128, 8, 3), (64, 256, 4, 3))


def candidates(num_pairs: int, num_experts: int, n: int, k: int) -> list[MoeTiles]:
    """Tiles worth timing for one pair bucket: the heuristic's, and its block height, half and
    double it (16 to 128 rows), by :data:`CANDIDATE_TILES` (none wider than the weights)."""
    base = heuristic_config(num_pairs, num_experts)
    heights = sorted({min(max(base.block_m * f // 2, 16), 128) for f in (1, 2, 4)})
    found = [base] + [MoeTiles(block_m, min(bn, max(16, triton.next_power_of_2(n))),
                               min(bk, max(16, triton.next_power_of_2(k))), warps, stages)
                      for block_m in heights for bn, bk, warps, stages in CANDIDATE_TILES]
    return list(dict.fromkeys(found))


# num_pairs changes with every batch: specialising on it would compile new variants mid-run.
@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, pair_ids_ptr, block_expert_ptr, route_w_ptr,
    num_pairs, N, K,
    stride_am, stride_we, stride_wn, stride_om,
    A_ROW_DIV: tl.constexpr, MUL_ROUTE_WEIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """out[pair] = a[pair // A_ROW_DIV] @ w[expert].T (times the pair's routing weight)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pair_ids_ptr + rows)
    row_mask = pairs < num_pairs
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + (pairs // A_ROW_DIV).to(tl.int64)[:, None] * stride_am + k[None, :]
    w_rows = (w_ptr + expert.to(tl.int64) * stride_we + n.to(tl.int64)[:, None] * stride_wn
              + k[None, :])
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_mask = (k_start + k) < K
        a = tl.load(a_rows + k_start, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + k_start, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
    out = acc.to(out_ptr.dtype.element_ty)
    if MUL_ROUTE_WEIGHT:  # rounded as `F.linear(h, w) * weight`: the product, then the scale
        route_w = tl.load(route_w_ptr + pairs, mask=row_mask, other=0.0)
        out = (out.to(tl.float32) * route_w.to(tl.float32)[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_om + n[None, :], out,
             mask=row_mask[:, None] & n_mask[None, :])


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, blocks: ExpertBlocks, tiles: MoeTiles,
                  a_row_div: int, route_weights: torch.Tensor | None = None) -> torch.Tensor:
    """``[num_pairs, N]``: each pair's row of ``a`` times its expert's ``w[e]`` (``[N, K]``),
    on ``tiles`` but for the block height, which is the grouping's."""
    n, k = w.shape[1:]
    out = torch.empty((blocks.num_pairs, n), dtype=a.dtype, device=a.device)
    grid = (blocks.block_expert.shape[0], triton.cdiv(n, tiles.block_n))
    pdl = programmatic_launch(a.device)
    _moe_gemm_kernel[grid](
        a, w, out, blocks.pair_ids, blocks.block_expert,
        route_weights if route_weights is not None else a,
        blocks.num_pairs, n, k,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_ROW_DIV=a_row_div, MUL_ROUTE_WEIGHT=route_weights is not None,
        DOT_PRECISION=dot_precision(a.dtype),
        BLOCK_M=blocks.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, PDL=pdl,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, launch_pdl=pdl,
    )
    return out


@triton.jit
def _sum_pairs_kernel(pairs_ptr, residual_ptr, out_ptr, hidden, TOP_K: tl.constexpr,
                      BLOCK_H: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    """One token's slice of features: its TOP_K pair rows (and its residual) summed in float32."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = h < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(pairs_ptr + (token * TOP_K + j) * hidden + h, mask=mask).to(tl.float32)
    if HAS_RESIDUAL:
        acc += tl.load(residual_ptr + token * hidden + h, mask=mask).to(tl.float32)
    tl.store(out_ptr + token * hidden + h, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _sum_pairs(pairs: torch.Tensor, top_k: int, residual: torch.Tensor | None) -> torch.Tensor:
    """``[T, H]``: the sum of each token's ``top_k`` rows of ``pairs`` (plus ``residual``)."""
    hidden = pairs.shape[1]
    out = torch.empty((pairs.shape[0] // top_k, hidden), dtype=pairs.dtype, device=pairs.device)
    block_h = 1024
    pdl = programmatic_launch(pairs.device)
    _sum_pairs_kernel[(out.shape[0], triton.cdiv(hidden, block_h))](
        pairs, residual if residual is not None else pairs, out, hidden, TOP_K=top_k,
        BLOCK_H=block_h, HAS_RESIDUAL=residual is not None, PDL=pdl,
        num_warps=1 if interpreted(pairs.device) else 4, launch_pdl=pdl)
    return out


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  route_weights: torch.Tensor, experts: torch.Tensor,
                  gate_up_config: MoeTiles | None = None,
                  down_config: MoeTiles | None = None,
                  activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  gate_up_bias: torch.Tensor | None = None,
                  down_bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_j route_weights[:, j] * expert_{experts[:, j]}(x)``, each expert a gated MLP:
    ``x [T, H]``, ``gate_up [E, 2I, H]``, ``down [E, H, I]``, routing ``[T, top_k]``;
    ``activation`` maps ``[P, 2I]`` to ``[P, I]`` (default SiLU and multiply), optional biases
    ``[E, 2I]`` and ``[E, H]`` (GPT-OSS), ``residual`` ``[T, H]`` added to the sum. Rounds as
    ``experts_loop`` does but sums a token's ``top_k`` outputs (and the residual) in float32,
    once. ``gate_up_config``, ``down_config``: each GEMM's tiles (default: :func:`select`'s for
    its shape)."""
    num_tokens, hidden = x.shape
    num_experts, width, _ = gate_up.shape
    if gate_up.shape[2] != hidden or down.shape != (num_experts, hidden, width // 2):
        raise ValueError(f"experts must be gate_up [E, 2I, {hidden}] and down [E, {hidden}, I]; "
                         f"got {tuple(gate_up.shape)} and {tuple(down.shape)}")
    if experts.shape != route_weights.shape or experts.shape[0] != num_tokens:
        raise ValueError(f"routing must be [{num_tokens}, top_k] weights and experts; got "
                         f"{tuple(route_weights.shape)} and {tuple(experts.shape)}")
    if any(t.stride(-1) != 1 for t in (x, gate_up, down)):
        raise ValueError("x and the experts' weights need contiguous rows")
    top_k = experts.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x) if residual is None else residual.clone()
    num_pairs = num_tokens * top_k
    up_tiles = gate_up_config or select(num_pairs, num_experts, width, hidden, x.device)
    down_tiles = down_config or select(num_pairs, num_experts, hidden, width // 2, x.device)
    up_blocks = group_by_expert(experts, num_experts, up_tiles.block_m)
    # One grouping serves both GEMMs where their block heights agree (the heuristic's always
    # do); else the down GEMM's pairs are grouped again by its own.
    down_blocks = up_blocks if down_tiles.block_m == up_tiles.block_m else \
        group_by_expert(experts, num_experts, down_tiles.block_m)
    h = _grouped_gemm(x, gate_up, up_blocks, up_tiles, a_row_div=top_k)
    # Row p of h and out is pair p (token p // top_k, its slot p % top_k): biases gather by it.
    pair_experts = experts.reshape(-1)
    if gate_up_bias is not None:
        h = h + gate_up_bias[pair_experts]
    h = silu_and_mul(h) if activation is None else activation(h)
    pair_weights = route_weights.reshape(-1).contiguous()
    if down_bias is None:
        out = _grouped_gemm(h, down, down_blocks, down_tiles, a_row_div=1,
                            route_weights=pair_weights)
    else:  # the bias goes in before the routing weight
        out = _grouped_gemm(h, down, down_blocks, down_tiles, a_row_div=1)
        out = (out + down_bias[pair_experts]) * pair_weights[:, None]
    return _sum_pairs(out, top_k, residual)

