"""The decode projections with narrow outputs (o_proj, down_proj) as split-K batched cuBLAS GEMMs.

At 16-256 rows cuBLAS runs Qwen3-0.6B's o_proj (1024 x 2048) and down_proj (1024 x 3072) as few
output tiles with a long K loop each (~6-8 us where the weights take ~1.5). Cutting K into S
slices and running them as one batched GEMM (`torch.bmm(..., out_dtype=torch.float32)` on
strided views, no copies) gives S times the programs; the S fp32 partial sums are added up by
the add + RMSNorm launch that follows these projections anyway (`add_rms_norm_parts`).

Times, as CUDA-graph replays of 28 layers with their own weights (so every call reads them from
HBM, as in the model): the GEMM + add + RMSNorm pair, and the GEMM alone, per (shape, rows, S).
Prints one JSON line per case.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import emit, environment, graph_us
from nanoserve.kernels.fused_ops import add_rms_norm, add_rms_norm_parts
from nanoserve.layers.split_k import split_k_views

SHAPES = {"o_proj": (1024, 2048), "down_proj": (1024, 3072),  # (N, K), Qwen3-0.6B
          "8b_o_proj": (4096, 4096), "8b_down_proj": (4096, 12288),
          # Wide outputs with short K, for the GEMM-only times (their consumers are not norms).
          "qkv_proj": (4096, 1024), "gate_up_proj": (6144, 1024)}
LAYERS = 28
EPS = 1e-6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    parser.add_argument("--parts", type=int, nargs="+", default=[2, 3, 4, 6, 8])
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--shapes", nargs="+", default=["o_proj", "down_proj"], choices=SHAPES)
    args = parser.parse_args()
    emit({"env": environment()})
    torch.manual_seed(0)
    dev = torch.device("cuda")
    for name in args.shapes:
        n, k = SHAPES[name]
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
                   for _ in range(LAYERS)]
        g = (1 + 0.1 * torch.randn(n, device=dev)).to(torch.bfloat16)
        for rows in args.rows:
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            residual = torch.randn(rows, n, device=dev, dtype=torch.bfloat16)
            ref_out, ref_res = add_rms_norm(F.linear(x, weights[0]), residual.clone(), g, EPS)
            record = {"shape": name, "n": n, "k": k, "rows": rows}
            r = residual.clone()
            record["cublas_pair_us"] = graph_us(
                [lambda w=w: add_rms_norm(F.linear(x, w), r, g, EPS) for w in weights],
                args.replays)
            record["cublas_gemm_us"] = graph_us([lambda w=w: F.linear(x, w) for w in weights],
                                                args.replays)
            for parts in args.parts:
                if k % (8 * parts):
                    continue
                views = [split_k_views(x, w, parts) for w in weights]
                xs, ws0 = views[0]
                out, res = add_rms_norm_parts(torch.bmm(xs, ws0, out_dtype=torch.float32),
                                              residual.clone(), g, EPS)
                scale = ref_out.float().abs().max().item()
                out_err = (out.float() - ref_out.float()).abs().max().item()
                record[f"s{parts}_out_err"] = out_err / scale
                record[f"s{parts}_res_err"] = (res.float() - ref_res.float()).abs().max().item()
                r = residual.clone()
                record[f"s{parts}_pair_us"] = graph_us(
                    [lambda v=v: add_rms_norm_parts(torch.bmm(*v, out_dtype=torch.float32), r, g,
                                                    EPS) for v in views], args.replays)
                record[f"s{parts}_gemm_us"] = graph_us(
                    [lambda v=v: torch.bmm(*v, out_dtype=torch.float32) for v in views],
                    args.replays)
            emit(record)
        x256 = torch.randn(256, k, device=dev, dtype=torch.bfloat16)
        emit({"shape": name, "kernels_s4_rows256": kernel_names(
            lambda: torch.bmm(*split_k_views(x256, weights[0], 4), out_dtype=torch.float32))})


def kernel_names(call) -> list[str]:
    """The CUDA kernels one call launches (a copy kernel here would mean a view was copied)."""
    call()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return sorted({e.name[:80] for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA})


if __name__ == "__main__":
    main()
