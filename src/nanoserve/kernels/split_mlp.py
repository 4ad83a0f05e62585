"""The whole SiLU-gated MLP of one decode row in one launch, split along the intermediate features.

At batch 1 the MLP is two dependent GEMVs (gate/up, then down), and at Qwen3-0.6B's size each
costs less in bytes than in the latency of being a kernel of its own: a launch that waits for
the one before it, reads its input from L2 and sums across threads. Here one program owns
``BLOCK_F`` intermediate features: it computes their gate and up products over the whole
hidden row, forms ``silu(gate) * up``, multiplies that by the same features' columns of the
down projection and adds the partial output row into a float32 accumulator with atomics. So
the down projection needs no launch and no program waits for another's activation; the price
is one float32 atomic per program and output feature, and an output that is a sum in no fixed
order (run to run it may differ in the last bits, as the GEMVs' sums of squares do).

The input row is ``h + d`` in float32 (the residual stream and the delta a split launch before
added), normalised in the program (RMSNorm without its weight, which is folded into the gate
and up columns), so the residual never rounds to 16 bits between layers. The down projection is
stored transposed (``[I, hidden]``) so that a program's columns are contiguous rows.

An experiment for batch-1 decode latency (``benchmarks/split_mlp.py``); the engine does not
call it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanoserve.kernels.common import interpreted, programmatic_launch
from nanoserve.kernels.fused_ops import silu_times
from nanoserve.kernels.skinny_gemm import W_LOAD


@triton.jit
def _split_mlp_kernel(
    h_ptr, d_ptr, w_gate_up_ptr, w_down_t_ptr, out_ptr,
    HIDDEN, INTER, eps,
    BLOCK_F: tl.constexpr, BLOCK_H: tl.constexpr, HAS_DELTA: tl.constexpr, PDL: tl.constexpr,
    ATOMIC: tl.constexpr, W_CACHE: tl.constexpr, W_EVICT: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    f = pid * BLOCK_F + tl.arange(0, BLOCK_F)
    c = tl.arange(0, BLOCK_H)
    f_mask = f < INTER
    c_mask = c < HIDDEN
    w_mask = f_mask[:, None] & c_mask[None, :]
    rows = f.to(tl.int64)[:, None] * HIDDEN + c[None, :]
    # All of the program's weights depend on nothing: fetched before waiting for the input.
    w_gate = tl.load(w_gate_up_ptr + rows, mask=w_mask, other=0.0,
                     cache_modifier=W_CACHE, eviction_policy=W_EVICT)
    w_up = tl.load(w_gate_up_ptr + INTER * HIDDEN + rows, mask=w_mask, other=0.0,
                   cache_modifier=W_CACHE, eviction_policy=W_EVICT)
    w_down = tl.load(w_down_t_ptr + rows, mask=w_mask, other=0.0,
                     cache_modifier=W_CACHE, eviction_policy=W_EVICT)
    if PDL:
        gdc_wait()
    x = tl.load(h_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        x += tl.load(d_ptr + c, mask=c_mask, other=0.0)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / HIDDEN + eps)
    gate = tl.sum(w_gate.to(tl.float32) * x[None, :], axis=1) * inv_rms
    up = tl.sum(w_up.to(tl.float32) * x[None, :], axis=1) * inv_rms
    dtype = w_gate_up_ptr.dtype.element_ty
    act = silu_times(gate.to(dtype), up.to(dtype)).to(tl.float32)
    part = tl.sum(w_down.to(tl.float32) * act[:, None], axis=0)
    if ATOMIC:
        tl.atomic_add(out_ptr + c, part, mask=c_mask, sem="relaxed")
    else:  # one row of partials per program (for timing the atomics' share)
        tl.store(out_ptr + pid * HIDDEN + c, part, mask=c_mask)


def split_mlp(h: torch.Tensor, delta: torch.Tensor | None, w_gate_up: torch.Tensor,
              w_down_t: torch.Tensor, out: torch.Tensor, eps: float, block_f: int = 8,
              num_warps: int = 4, atomic: bool = True) -> torch.Tensor:
    """Add ``down(silu(gate) * up)`` of ``rmsnorm(h + delta)`` into ``out``, for one row.

    ``h``: ``[hidden]`` (16 bits or float32); ``delta``: float32 ``[hidden]`` or None;
    ``w_gate_up``: ``[2I, hidden]``, gate rows then up rows, the norm's weight folded into its
    columns; ``w_down_t``: ``[I, hidden]``, the down projection transposed; ``out``: float32
    ``[hidden]``, added into. With ``atomic=False`` ``out`` is ``[programs, hidden]`` and each
    program stores its partial row there instead (a timing aid). Returns ``out``.
    """
    hidden = h.shape[-1]
    inter = w_down_t.shape[0]
    if w_gate_up.shape != (2 * inter, hidden) or w_down_t.shape != (inter, hidden):
        raise ValueError(f"split_mlp needs w_gate_up [2I, H] and w_down_t [I, H]; got "
                         f"{tuple(w_gate_up.shape)} and {tuple(w_down_t.shape)}")
    for name, t in (("h", h), ("delta", delta), ("out", out), ("w_gate_up", w_gate_up),
                    ("w_down_t", w_down_t)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"split_mlp needs a contiguous {name}")
    if out.dtype != torch.float32 or (delta is not None and delta.dtype != torch.float32):
        raise ValueError("split_mlp accumulates in float32: out and delta must be float32")
    programs = triton.cdiv(inter, block_f)
    if out.numel() != (hidden if atomic else programs * hidden):
        raise ValueError(f"out has {out.numel()} elements, expected "
                         f"{hidden if atomic else programs * hidden}")
    pdl = programmatic_launch(h.device)
    _split_mlp_kernel[(programs,)](
        h, delta if delta is not None else out, w_gate_up, w_down_t, out,
        hidden, inter, eps,
        BLOCK_F=block_f, BLOCK_H=triton.next_power_of_2(hidden), HAS_DELTA=delta is not None,
        PDL=pdl, ATOMIC=atomic, W_CACHE=W_LOAD[0], W_EVICT=W_LOAD[1],
        num_warps=1 if interpreted(h.device) else num_warps, launch_pdl=pdl,
    )
    return out
