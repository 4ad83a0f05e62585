"""Programmatic edges into cuBLAS's GEMMs inside a CUDA graph: are they safe, and what would
they save? (needs an sm_90 GPU; prints JSON lines)

1. *Safety.* A Triton kernel signals its dependents at once, spins ~0.1 ms, then writes x; a
   cuBLAS GEMM (plain, or the split-K ``bmm`` of ``layers.split_k``) reads x. With the edge
   between them made programmatic (``graph_edges``) the GEMM launches while the writer spins,
   so its result is only right if its kernel waits for its producer before loading. x is
   zeroed before each of 10 replays; a GEMM that does not wait reads zeros or part of x.
2. *Time.* 28 layers of decode-shaped work (Qwen3-0.6B: norm, gate/up, SiLU-and-mul, down,
   norm, qkv, norm, o_proj; the Triton kernels launched programmatically, as in the engine)
   as one graph, replayed with the edges into the GEMMs as captured and made programmatic,
   twice each, interleaved. Only an upper bound where (1) finds the GEMMs not waiting: then
   the programmatic graph races.

    python benchmarks/graph_pdl.py [--rows 16 64 128 256]
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from common import emit, replay_ms
from graph_edges import is_cublas_sm90_gemm, kernel_names, make_edges_programmatic
from nanoserve.kernels.fused_ops import rms_norm, silu_and_mul
from nanoserve.layers.split_k import split_k_parts, split_k_views

DEV = "cuda"
DTYPE = torch.bfloat16
SPINS = 50_000  # dependent FMAs in each writer program before it stores: ~0.1 ms


@triton.jit
def _slow_fill_kernel(x_ptr, n, value, spins, BLOCK: tl.constexpr):
    gdc_launch_dependents()  # a programmatically dependent GEMM may launch now
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for _ in range(spins):
        acc = acc * 0.5 + 1.0
    tl.store(x_ptr + offs, tl.where(acc > 0, value, 0.0).to(x_ptr.dtype.element_ty),
             mask=offs < n)


def capture(fn, convert: bool) -> tuple[torch.cuda.CUDAGraph, int]:
    """``fn`` captured (after one warm-up call) with its edges into cuBLAS's GEMMs made
    programmatic or left as captured; returns the instantiated graph and how many changed."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        fn()
    changed = make_edges_programmatic(graph, is_cublas_sm90_gemm) if convert else 0
    graph.instantiate()
    return graph, changed


def safety(rows: int, n: int, k: int) -> dict:
    """The writer, then the engine's GEMM for this shape, with the edge made programmatic."""
    torch.manual_seed(0)
    x = torch.zeros(rows, k, device=DEV, dtype=DTYPE)
    w = (torch.randn(n, k, device=DEV) / k ** 0.5).to(DTYPE)
    parts = split_k_parts(rows, n, k)
    out = {}

    def writer_then_gemm() -> None:
        _slow_fill_kernel[(triton.cdiv(x.numel(), 1024),)](x, x.numel(), 0.5, SPINS, BLOCK=1024)
        if parts > 1:
            out["y"] = torch.bmm(*split_k_views(x, w, parts), out_dtype=torch.float32)
        else:
            out["y"] = F.linear(x, w)

    graph, changed = capture(writer_then_gemm, convert=True)
    expected = F.linear(torch.full_like(x, 0.5), w).float()
    wrong = 0
    for _ in range(10):
        x.zero_()
        graph.replay()
        got = out["y"].float().sum(0) if parts > 1 else out["y"].float()
        wrong += not torch.allclose(got, expected, atol=2e-2, rtol=2e-2)
    return {"rows": rows, "n": n, "k": k, "split_k": parts, "edges_changed": changed,
            "wrong_replays_of_10": wrong, "edges": kernel_names(graph)}


def layers_chain(rows: int, num_layers: int = 28) -> Callable[[], None]:
    """Decode-shaped work of ``num_layers`` Qwen3-0.6B layers at ``rows`` rows (attention left
    out: a norm stands in for it)."""
    g = torch.ones(1024, device=DEV, dtype=DTYPE)
    g2 = torch.ones(2048, device=DEV, dtype=DTYPE)
    w_gu = [torch.randn(6144, 1024, device=DEV, dtype=DTYPE) / 32 for _ in range(num_layers)]
    w_d = [torch.randn(1024, 3072, device=DEV, dtype=DTYPE) / 55 for _ in range(num_layers)]
    w_qkv = [torch.randn(4096, 1024, device=DEV, dtype=DTYPE) / 32 for _ in range(num_layers)]
    w_o = [torch.randn(1024, 2048, device=DEV, dtype=DTYPE) / 45 for _ in range(num_layers)]
    x = torch.randn(rows, 1024, device=DEV, dtype=DTYPE)

    def run() -> None:
        h = x
        for i in range(num_layers):
            h = F.linear(silu_and_mul(F.linear(rms_norm(h, g, 1e-6), w_gu[i])), w_d[i])
            qkv = F.linear(rms_norm(h, g, 1e-6), w_qkv[i])
            h = F.linear(rms_norm(qkv[:, :2048], g2, 1e-6), w_o[i])

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128, 256])
    args = parser.parse_args()
    for rows in args.rows:
        for n, k in [(4096, 1024), (6144, 1024), (1024, 3072), (1024, 2048), (151936, 1024)]:
            emit({"bench": "graph_pdl_safety", **safety(rows, n, k)})
    for rows in args.rows:
        run = layers_chain(rows)
        times = {}
        for label, convert in [("captured", False), ("programmatic", True),
                               ("captured_again", False), ("programmatic_again", True)]:
            graph, changed = capture(run, convert)
            times[label] = round(replay_ms(graph, 50), 4)
            times[f"{label}_edges_changed"] = changed
        emit({"bench": "graph_pdl_chain", "rows": rows, "layers": 28, "ms": times})


if __name__ == "__main__":
    main()
