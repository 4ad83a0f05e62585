"""Batch-1 MLPs back to back: the engine's two GEMVs against one split launch (an experiment).

A layer's MLP in the engine at batch 1 is two programmatically launched skinny GEMVs: gate/up
(with the norm and SiLU-and-mul) and down (with the residual add and the next norm's sum of
squares). The kernel here does both in one launch: each program owns ``BLOCK_F`` intermediate
features, computes their gate and up products over the whole hidden row (normalised in the
program, the norm's weight folded into W), forms ``silu(gate) * up``, multiplies it by the
same features' columns of the down projection (stored transposed, ``[I, hidden]``, so those
columns are contiguous rows) and adds its partial output row into a float32 row with atomics.
The input is ``h + d`` in float32: an engine built on it would keep the residual in float32.

It lost (run 193, docs/kernels.md): 9.1 us per layer at best against the engine's 8.1. Storing
per-program partial rows instead of the atomics (``store`` variants: wrong sums, a timing aid)
took 6.6, so the ~200k float32 atomics per layer cost more than the launch they save.

This times ``--layers`` MLPs of ``--shape`` chained in one CUDA graph, every layer's weights
distinct (so they come from HBM, as in the engine), per tiling; it also checks one split MLP
against float64. One JSON line per variant: microseconds per layer.

    python benchmarks/split_mlp.py [--shape qwen3-0.6b] [--tiles 8:4 16:8 ...]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from common import SHAPES, emit, environment, graph_us
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanoserve.kernels.common import interpreted, programmatic_launch
from nanoserve.kernels.fused_ops import silu_times
from nanoserve.kernels.skinny_gemm import W_LOAD, skinny_linear, skinny_rms_linear

EPS = 1e-6
DTYPE = torch.bfloat16


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


def reference_error(h, w_gate_up, w_down_t) -> float:
    """Max |split_mlp - float64| over one layer, relative to the output's largest magnitude."""
    x = h.double() / torch.sqrt(h.double().pow(2).mean() + EPS)
    gate, up = (x @ w_gate_up.double().T).chunk(2)
    ref = (F.silu(gate) * up) @ w_down_t.double()
    out = split_mlp(h, None, w_gate_up, w_down_t, torch.zeros_like(h, dtype=torch.float32), EPS)
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--tiles", nargs="+", default=["4:4", "8:4", "8:8", "16:4", "16:8", "32:8"],
                        help="split MLP tilings, features per program : warps")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w_gate_up = [torch.randn(2 * inter, hidden, generator=gen, device="cuda", dtype=DTYPE)
                 / hidden ** 0.5 for _ in range(args.layers)]
    w_down = [torch.randn(hidden, inter, generator=gen, device="cuda", dtype=DTYPE)
              / inter ** 0.5 for _ in range(args.layers)]
    w_down_t = [w.T.contiguous() for w in w_down]
    h16 = torch.randn(1, hidden, generator=gen, device="cuda", dtype=DTYPE)
    sum_squares = torch.zeros(args.layers + 1, 1, device="cuda")
    h32 = torch.randn(hidden, generator=gen, device="cuda")
    deltas = torch.zeros(args.layers, hidden, device="cuda")
    env = environment()
    base = dict(bench="split_mlp", shape=args.shape, layers=args.layers, **env)

    sum_squares[0] = h16.float().pow(2).sum()

    def engine_chain() -> None:
        sum_squares[1:].zero_()
        for i in range(args.layers):
            act = skinny_rms_linear(h16, sum_squares[i], EPS, w_gate_up[i], activate=True)
            skinny_linear(act, w_down[i], residual=h16, sum_squares=sum_squares[i + 1])

    emit({**base, "variant": "engine_gemvs",
          "us_per_layer": round(graph_us([engine_chain], args.replays) / args.layers, 3)})
    emit({**base, "variant": "check", "max_rel_error": reference_error(
        torch.randn(hidden, generator=gen, device="cuda", dtype=DTYPE), w_gate_up[0],
        w_down_t[0])})
    for tile in args.tiles:
        block_f, warps = (int(v) for v in tile.split(":"))
        programs = -(-inter // block_f)
        partials = torch.zeros(programs, hidden, device="cuda")
        for atomic in (True, False):
            def split_chain(block_f=block_f, warps=warps, atomic=atomic) -> None:
                deltas.zero_()
                for i in range(args.layers):
                    out = deltas[i] if atomic else partials
                    split_mlp(h32, deltas[i - 1] if i else None, w_gate_up[i], w_down_t[i], out,
                              EPS, block_f=block_f, num_warps=warps, atomic=atomic)

            us = graph_us([split_chain], args.replays) / args.layers
            emit({**base, "variant": f"split{'' if atomic else '_store'}", "block_f": block_f,
                  "num_warps": warps, "us_per_layer": round(us, 3)})


if __name__ == "__main__":
    main()
