"""The batch-1 MLP in one launch: RMSNorm, gate/up, SiLU-and-mul, down and the residual add.

At batch 1 the MLP is two GEMVs (gate/up with the norm, then down of ``silu(gate) * up`` with
the residual add), and down cannot start before every gate/up program has finished: one
dependent launch per layer. Here each program owns ``BLOCK_I`` intermediate features instead:

1. it streams their gate and up rows of W against the residual row ``h``, scales the products
   by ``rsqrt(mean(h^2) + eps)`` (the norm's weight is folded into W, its sum of squares comes
   from the GEMV before) and forms ``act = silu(gate) * up`` for those features;
2. it streams the same features' rows of ``W_down^T`` and adds ``act @ W_down^T[slice]``, the
   down projection's share of those features, into a float32 accumulator with atomics;
3. it counts itself done on an atomic counter; the program that arrives last adds the
   accumulator into the residual in place (rounded as ``F.linear(...) + residual``), writes
   the new row's sum of squares for the next norm, and zeroes the accumulator and counter for
   the next call.

Nothing waits on other programs (no grid barrier): the one serial step is the last program's
pass over ``H`` values. Down's weight must be stored transposed (``weight.stride(0) == 1``),
so that a program's slice is ``BLOCK_I`` contiguous rows; cuBLAS takes the same tensor at larger
batches as it is. Programmatically launched like the other batch-1 kernels.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanoserve.kernels.common import interpreted, programmatic_launch


class FusedMLPConfig(NamedTuple):
    """Intermediate features per program, chunk widths along the hidden size for the gate/up
    and the down loops, warps, and whether gate/up sums over the hidden size once at the end
    (elementwise accumulators, more registers) rather than once per chunk."""

    block_i: int = 8
    block_h: int = 256
    block_j: int = 512
    num_warps: int = 4
    defer_sum: bool = True


@triton.jit
def _fused_mlp_kernel(
    h_ptr, ss_in_ptr, w_gu_ptr, w_d_ptr, acc_ptr, count_ptr, ss_out_ptr,
    H, I, eps, stride_gu, stride_d,
    BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr,
    DEFER_SUM: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # the next layer's qkv GEMV may start fetching its weights
        gdc_launch_dependents()
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_mask = i < I
    k = tl.arange(0, BLOCK_H)
    gate_rows = w_gu_ptr + i.to(tl.int64)[:, None] * stride_gu + k[None, :]
    up_rows = gate_rows + I * stride_gu
    w_mask = i_mask[:, None] & (k < H)[None, :]
    # W depends on nothing: the first chunk is fetched before waiting for h.
    w_gate = tl.load(gate_rows, mask=w_mask, other=0.0)
    w_up = tl.load(up_rows, mask=w_mask, other=0.0)
    if PDL:
        gdc_wait()
    x = tl.load(h_ptr + k, mask=k < H, other=0.0).to(tl.float32)[None, :]
    gate = w_gate.to(tl.float32) * x
    up = w_up.to(tl.float32) * x
    if not DEFER_SUM:
        gate = tl.sum(gate, axis=1)
        up = tl.sum(up, axis=1)
    for k0 in range(BLOCK_H, H, BLOCK_H):
        w_mask = i_mask[:, None] & ((k0 + k) < H)[None, :]
        w_gate = tl.load(gate_rows + k0, mask=w_mask, other=0.0)
        w_up = tl.load(up_rows + k0, mask=w_mask, other=0.0)
        x = tl.load(h_ptr + k0 + k, mask=(k0 + k) < H, other=0.0).to(tl.float32)[None, :]
        if DEFER_SUM:
            gate += w_gate.to(tl.float32) * x
            up += w_up.to(tl.float32) * x
        else:
            gate += tl.sum(w_gate.to(tl.float32) * x, axis=1)
            up += tl.sum(w_up.to(tl.float32) * x, axis=1)
    if DEFER_SUM:
        gate = tl.sum(gate, axis=1)
        up = tl.sum(up, axis=1)
    dtype = h_ptr.dtype.element_ty
    # Rounded where the two-GEMV path rounds: gate/up's outputs, silu's result, the product.
    scale = tl.rsqrt(tl.load(ss_in_ptr) / H + eps)
    gate = (gate * scale).to(dtype).to(tl.float32)
    up = (up * scale).to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    act = tl.where(i_mask, (act * up).to(dtype).to(tl.float32), 0.0)

    j = tl.arange(0, BLOCK_J)
    down_rows = w_d_ptr + i.to(tl.int64)[:, None] * stride_d + j[None, :]
    for j0 in range(0, H, BLOCK_J):
        j_mask = (j0 + j) < H
        w_down = tl.load(down_rows + j0, mask=i_mask[:, None] & j_mask[None, :], other=0.0)
        part = tl.sum(act[:, None] * w_down.to(tl.float32), axis=0)
        tl.atomic_add(acc_ptr + j0 + j, part, mask=j_mask, sem="relaxed")

    tl.debug_barrier()  # every thread's atomics come before this program counts itself done
    done = tl.atomic_add(count_ptr, 1, sem="acq_rel")
    if done == tl.num_programs(0) - 1:
        ss = tl.zeros([BLOCK_J], tl.float32)
        for j0 in range(0, H, BLOCK_J):
            jj = j0 + j
            j_mask = jj < H
            total = tl.load(acc_ptr + jj, mask=j_mask, other=0.0, cache_modifier=".cg")
            r = tl.load(h_ptr + jj, mask=j_mask, other=0.0)
            out = (total.to(dtype).to(tl.float32) + r.to(tl.float32)).to(dtype)
            tl.store(h_ptr + jj, out, mask=j_mask)
            tl.store(acc_ptr + jj, tl.zeros([BLOCK_J], tl.float32), mask=j_mask)
            stored = tl.where(j_mask, out.to(tl.float32), 0.0)
            ss += stored * stored
        tl.store(ss_out_ptr, tl.sum(ss, axis=0))
        tl.store(count_ptr, 0)


# Best tiles on an H200, keyed by (hidden, intermediate) (benchmarks/fused_mlp.py --sweep).
TUNED: dict[tuple[int, int], FusedMLPConfig] = {}


def serves(hidden: int, intermediate: int, dtype: torch.dtype) -> bool:
    """Whether a model on one CUDA device runs its batch-1 MLPs through this kernel: 16-bit
    weights of a shape where it measured faster than the two GEMVs (``TUNED``)."""
    return dtype in (torch.bfloat16, torch.float16) and (hidden, intermediate) in TUNED


def default_config(hidden: int, intermediate: int, device: torch.device) -> FusedMLPConfig:
    """Tiles for an MLP of this shape: the sweep's best where measured, else the defaults."""
    if interpreted(device):
        return FusedMLPConfig(block_i=4, block_h=32, block_j=32, num_warps=1)
    return TUNED.get((hidden, intermediate), FusedMLPConfig())


class FusedMLPScratch:
    """The float32 accumulator for down's output and the programs' done counter, zero between
    calls (each call's last program leaves them so); one per hidden size and device."""

    def __init__(self, hidden: int, device: torch.device):
        self.acc = torch.zeros(hidden, dtype=torch.float32, device=device)
        self.count = torch.zeros(1, dtype=torch.int32, device=device)


def fused_mlp(h: torch.Tensor, sum_squares_in: torch.Tensor, eps: float, w_gate_up: torch.Tensor,
              w_down: torch.Tensor, sum_squares_out: torch.Tensor, scratch: FusedMLPScratch,
              config: FusedMLPConfig | None = None) -> torch.Tensor:
    """``h += down(silu(gate) * up)`` of ``norm(h)`` for one row, in place; returns ``h``.

    ``h``: ``[1, H]``, contiguous (16-bit in the model); ``sum_squares_in``: float32 ``[1]``, its sum of
    squares; ``w_gate_up``: ``[2I, H]`` contiguous, the gate rows then the up rows, the norm's
    weight folded in; ``w_down``: ``[H, I]`` stored transposed (``stride(0) == 1``). The
    updated row's sum of squares goes to ``sum_squares_out`` (float32 ``[1]``).
    """
    hidden = h.shape[-1]
    inter = w_gate_up.shape[0] // 2
    if h.shape != (1, hidden) or not h.is_contiguous() or not h.dtype.is_floating_point:
        raise ValueError(f"h must be one contiguous row, got {tuple(h.shape)} {h.dtype}")
    if w_gate_up.dtype != h.dtype or w_down.dtype != h.dtype:
        raise ValueError(f"weights must be in h's dtype {h.dtype}, "
                         f"got {w_gate_up.dtype} and {w_down.dtype}")
    if w_gate_up.shape != (2 * inter, hidden) or w_gate_up.stride(1) != 1:
        raise ValueError(f"w_gate_up must be [2I, {hidden}] with contiguous rows, "
                         f"got {tuple(w_gate_up.shape)}")
    if w_down.shape != (hidden, inter) or w_down.stride(0) != 1:
        raise ValueError(f"w_down must be [{hidden}, {inter}] stored transposed "
                         f"(stride(0) == 1), got {tuple(w_down.shape)} strides {w_down.stride()}")
    for name, t in (("sum_squares_in", sum_squares_in), ("sum_squares_out", sum_squares_out)):
        if t.shape != (1,) or t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 [1], got {tuple(t.shape)} {t.dtype}")
    if scratch.acc.shape != (hidden,):
        raise ValueError(f"scratch is for hidden size {scratch.acc.shape[0]}, not {hidden}")
    cfg = config or default_config(hidden, inter, h.device)
    pdl = programmatic_launch(h.device)
    _fused_mlp_kernel[(triton.cdiv(inter, cfg.block_i),)](
        h, sum_squares_in, w_gate_up, w_down, scratch.acc, scratch.count, sum_squares_out,
        hidden, inter, eps, w_gate_up.stride(0), w_down.stride(1),
        BLOCK_I=cfg.block_i, BLOCK_H=cfg.block_h, BLOCK_J=cfg.block_j,
        DEFER_SUM=cfg.defer_sum, PDL=pdl, num_warps=cfg.num_warps, num_stages=1, launch_pdl=pdl,
    )
    return h
