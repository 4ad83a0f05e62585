"""How fast the device can only read: the ceiling that the batch-1 GEMVs stream W against. Needs CUDA.

The floors in docs/benchmarks.md divide bytes by the copy bandwidth (bytes read + written by a
large copy). A GEMV only reads, so its ceiling may differ. This times a Triton kernel that reads
a bf16 buffer and sums it (one float per program, so nothing is written that matters):

- ``large``: one read of 2 GB, per tiling (elements per load x loads per program x warps), and
  ``torch.sum`` over the same buffer;
- ``per_call``: reads of the Qwen3-8B projections' sizes (33.5, 50, 100, 201 MB), each a
  separate kernel captured back to back in one CUDA graph over rotating copies, the way a
  decode step launches its GEMVs: what a projection of that size costs if it did nothing but
  read;
- ``chain``: the four reads of each of 36 layers (qkv, o, gate/up, down; 13.9 GB, each layer
  its own buffers) in one graph, with each size's best tiling, plainly or programmatically
  launched (each kernel issues its loads, then waits for the one before it, as the batch-1
  GEMVs do): the least a Qwen3-8B forward's projections can take as four launches a layer.

One JSON line per measurement.

    python benchmarks/read_bandwidth.py
"""
from __future__ import annotations

import itertools
import json

import torch
import triton
import triton.language as tl
from common import SHAPES, copy_bandwidth_gbs, graph_us, timed_ms
from skinny_gemm import PROJECTIONS
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

LARGE_BYTES = 2 << 30
ROTATE_BYTES = 512 << 20
# Qwen3-8B's projections in a layer's order (qkv, o, gate/up, down): bytes of W in bf16.
PROJECTION_BYTES = {name: n * k * 2 for name, n, k in PROJECTIONS["qwen3-8b"]}
LAYERS = SHAPES["qwen3-8b"]["num_hidden_layers"]
TILINGS = list(itertools.product((2048, 4096, 8192), (1, 2, 4), (4, 8)))


@triton.jit
def _read_sum_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, LOADS: tl.constexpr,
                     PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    start = tl.program_id(0).to(tl.int64) * BLOCK * LOADS
    offs = tl.arange(0, BLOCK)
    idx = start + offs
    first = tl.load(x_ptr + idx, mask=idx < n, other=0.0)
    if PDL:  # as a GEMV: its first weights requested, then wait for the kernel before
        gdc_wait()
    acc = first.to(tl.float32)
    for i in tl.static_range(1, LOADS):
        idx = start + i * BLOCK + offs
        acc += tl.load(x_ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


def read_sum(x: torch.Tensor, out: torch.Tensor, block: int, loads: int, warps: int,
             pdl: bool = False) -> None:
    grid = triton.cdiv(x.numel(), block * loads)
    _read_sum_kernel[(grid,)](x, out, x.numel(), BLOCK=block, LOADS=loads, PDL=pdl,
                              num_warps=warps, launch_pdl=pdl)


def main() -> None:
    print(json.dumps({"bench": "read_bandwidth", "copy_gbs": round(copy_bandwidth_gbs(), 1)}),
          flush=True)
    x = torch.randn(LARGE_BYTES // 2, device="cuda").to(torch.bfloat16)
    out = torch.empty(triton.cdiv(x.numel(), 2048), device="cuda")
    expected = x.float().sum().item()
    for block, loads, warps in TILINGS:
        read_sum(x, out, block, loads, warps)
        got = out[:triton.cdiv(x.numel(), block * loads)].sum().item()
        ms = timed_ms(lambda: read_sum(x, out, block, loads, warps), repeats=1)
        print(json.dumps({"bench": "read_bandwidth", "what": "large", "block": block,
                          "loads": loads, "warps": warps, "read_gbs": round(LARGE_BYTES / ms / 1e6, 1),
                          "ok": abs(got - expected) <= 1e-3 * x.numel() ** 0.5}), flush=True)
    ms = timed_ms(lambda: x.sum(dtype=torch.float32), repeats=1)
    print(json.dumps({"bench": "read_bandwidth", "what": "large", "torch_sum_gbs":
                      round(LARGE_BYTES / ms / 1e6, 1)}), flush=True)
    del x
    best_tiling = {}
    for name, nbytes in PROJECTION_BYTES.items():
        copies = [torch.empty(nbytes // 2, device="cuda", dtype=torch.bfloat16).normal_()
                  for _ in range(max(2, -(-ROTATE_BYTES // nbytes)))]
        small_out = torch.empty(triton.cdiv(nbytes // 2, 2048), device="cuda")
        best = min((graph_us([lambda c=c: read_sum(c, small_out, b, n, w) for c in copies]), b, n, w)
                   for b, n, w in TILINGS)
        print(json.dumps({"bench": "read_bandwidth", "what": "per_call", "proj": name,
                          "mb": round(nbytes / 1e6, 1), "best_us": round(best[0], 2),
                          "read_gbs": round(nbytes / best[0] / 1e3, 1), "tiling": best[1:]}),
              flush=True)
        best_tiling[name] = best[1:]
        del copies
        torch.cuda.empty_cache()
    layers = [{name: torch.empty(PROJECTION_BYTES[name] // 2, device="cuda",
                                 dtype=torch.bfloat16).normal_() for name in PROJECTION_BYTES}
              for _ in range(LAYERS)]
    chain_out = torch.empty(triton.cdiv(PROJECTION_BYTES["gate_up"] // 2, 2048), device="cuda")
    layer_bytes = sum(PROJECTION_BYTES.values())
    for pdl in (False, True):
        calls = [lambda t=layer[name], name=name: read_sum(t, chain_out, *best_tiling[name],
                                                           pdl=pdl)
                 for layer in layers for name in PROJECTION_BYTES]
        per_layer = graph_us(calls) * len(PROJECTION_BYTES)
        print(json.dumps({"bench": "read_bandwidth", "what": "chain", "pdl": pdl,
                          "layers": LAYERS, "us_per_layer": round(per_layer, 2),
                          "forward_ms": round(per_layer * LAYERS / 1e3, 3),
                          "read_gbs": round(layer_bytes / per_layer / 1e3, 1)}), flush=True)


if __name__ == "__main__":
    main()
