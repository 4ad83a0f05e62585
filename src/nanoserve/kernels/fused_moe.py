"""The experts of a mixture-of-experts MLP on the GPU: two grouped GEMMs, no host sync.

The CPU path (``layers/moe.py``) runs the experts one by one over their tokens, which needs
the routing on the host. Here the routing stays on the device:

1. ``group_by_expert`` sorts the (token, slot) pairs of the routing by expert and pads each
   expert's group to a multiple of ``block_m`` rows, with tensor ops of fixed shapes, so a
   CUDA graph can hold them: the number of blocks is bounded by the batch alone, and blocks
   past the last used one carry expert -1 and exit at once.
2. ``_moe_gemm_kernel`` multiplies each block of rows by its expert's weights (one program per
   block and ``BLOCK_N`` output features, ``tl.dot`` on the tensor cores). The gate/up GEMM
   gathers its rows from the tokens; the down GEMM reads the activated rows of the pairs and
   scales each by its routing weight.
3. Each token's ``top_k`` results are summed.

This is vLLM's fused-MoE design (sorted, padded expert blocks) written small; the grid is
sized for the worst case, so a block's expert decides its work at run time.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanoserve.kernels.common import dot_precision, interpreted
from nanoserve.kernels.fused_ops import silu_and_mul


class ExpertBlocks(NamedTuple):
    """The routing's (token, slot) pairs grouped by expert in blocks of ``block_m`` rows.

    ``pair_ids`` (int32 ``[num_blocks * block_m]``) holds, for each row, the index
    ``token * top_k + slot`` of a pair, or ``num_pairs`` for a padding row; ``block_expert``
    (int32 ``[num_blocks]``) the expert of each block, -1 for the unused blocks at the end.
    """

    pair_ids: torch.Tensor
    block_expert: torch.Tensor
    block_m: int
    num_pairs: int


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks enough for any routing of ``num_pairs`` pairs: every used expert may leave one
    block partly empty, and at most ``min(num_experts, num_pairs)`` experts are used."""
    return triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


def group_by_expert(experts: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Group the pairs of ``experts`` (``[T, top_k]`` expert indices) by expert; within an
    expert the pairs stay in token order. Device ops of fixed shapes only (graph-capturable)."""
    device = experts.device
    flat = experts.reshape(-1).long()
    num_pairs = flat.numel()
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded_end = torch.cumsum((counts + block_m - 1) // block_m * block_m, 0)
    padded_start = padded_end - (counts + block_m - 1) // block_m * block_m
    sorted_expert = flat[order]
    # A pair's row: its expert's first padded row + its rank among the expert's pairs.
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_expert]
    pair_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    pair_ids[padded_start[sorted_expert] + rank] = order.to(torch.int32)
    block_start = torch.arange(num_blocks, device=device) * block_m
    # Empty experts have padded_start == padded_end, so the first end past a block's start is
    # its expert's.
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_start < padded_end[-1], block_expert, -1).to(torch.int32)
    return ExpertBlocks(pair_ids, block_expert, block_m, num_pairs)


class MoeTiles(NamedTuple):
    """Tile sizes of both grouped GEMMs for one batch size."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def moe_tiles(num_pairs: int, num_experts: int, device: torch.device) -> MoeTiles:
    """Blocks of 16 rows (the smallest ``tl.dot`` tile) while experts get a few pairs each, as
    in decode; 64 once they get many, as in prefill."""
    if interpreted(device):
        return MoeTiles(16, 16, 32, 1, 1)
    if num_pairs <= 4 * num_experts:
        return MoeTiles(16, 64, 128, 4, 4)
    return MoeTiles(64, 128, 64, 8, 3)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, pair_ids_ptr, block_expert_ptr, route_w_ptr,
    num_pairs, N, K,
    stride_am, stride_we, stride_wn, stride_om,
    A_ROW_DIV: tl.constexpr, MUL_ROUTE_WEIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[pair] = a[pair // A_ROW_DIV] @ w[expert].T (times the pair's routing weight)."""
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
    """``[num_pairs, N]``: each pair's row of ``a`` times its expert's ``w[e]`` (``[N, K]``)."""
    n, k = w.shape[1:]
    out = torch.empty((blocks.num_pairs, n), dtype=a.dtype, device=a.device)
    grid = (blocks.block_expert.shape[0], triton.cdiv(n, tiles.block_n))
    _moe_gemm_kernel[grid](
        a, w, out, blocks.pair_ids, blocks.block_expert,
        route_weights if route_weights is not None else a,
        blocks.num_pairs, n, k,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_ROW_DIV=a_row_div, MUL_ROUTE_WEIGHT=route_weights is not None,
        DOT_PRECISION=dot_precision(a.dtype),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  route_weights: torch.Tensor, experts: torch.Tensor,
                  tiles: MoeTiles | None = None) -> torch.Tensor:
    """``sum_j route_weights[:, j] * expert_{experts[:, j]}(x)``, each expert a SiLU-gated MLP.

    ``x`` is ``[T, H]``; ``gate_up`` ``[E, 2I, H]`` ([gate | up] rows), ``down`` ``[E, H, I]``,
    both with contiguous rows; ``route_weights`` (x's dtype) and ``experts`` (integer) are
    ``[T, top_k]``. Rounds where the per-expert loop does (each product, the activation, the
    weighted output) but sums a token's ``top_k`` outputs in float32, once.
    """
    num_tokens, hidden = x.shape
    num_experts, width, _ = gate_up.shape
    top_k = experts.shape[1]
    if gate_up.shape[2] != hidden or down.shape != (num_experts, hidden, width // 2):
        raise ValueError(f"experts must be gate_up [E, 2I, {hidden}] and down [E, {hidden}, I]; "
                         f"got {tuple(gate_up.shape)} and {tuple(down.shape)}")
    if experts.shape != route_weights.shape or experts.shape[0] != num_tokens:
        raise ValueError(f"routing must be [{num_tokens}, top_k] weights and experts; got "
                         f"{tuple(route_weights.shape)} and {tuple(experts.shape)}")
    for t in (x, gate_up, down):
        if t.stride(-1) != 1:
            raise ValueError("x and the experts' weights need contiguous rows")
    if num_tokens == 0:
        return torch.zeros_like(x)
    tiles = tiles or moe_tiles(num_tokens * top_k, num_experts, x.device)
    blocks = group_by_expert(experts, num_experts, tiles.block_m)
    h = _grouped_gemm(x, gate_up, blocks, tiles, a_row_div=top_k)
    h = silu_and_mul(h)
    out = _grouped_gemm(h, down, blocks, tiles, a_row_div=1,
                        route_weights=route_weights.reshape(-1).contiguous())
    return out.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
