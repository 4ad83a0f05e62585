"""The fused MoE experts against the per-expert loop, at Qwen3-30B-A3B's expert shapes. One JSON
line per batch size (and tile override).

Each call reads a different layer's experts (``--layers`` copies, cycled), so the experts come
from HBM as in the model. The fused path is timed as a CUDA graph of one call per layer (as
decode runs it); the loop, which reads the routing on the host, eagerly, with CUDA events
around all layers. ``floor_us`` is the bytes of the experts the batch's routing touches over
the measured copy bandwidth.

    python benchmarks/fused_moe.py [--tokens 1 16 256] [--tiles BM:BN:BK:WARPS:STAGES ...]

The first line per batch size has ``select``'s tiles (gate_up's, then down's), then one per
``--tiles`` override (both GEMMs'); ``group_us`` is the grouping launch alone.
"""
from __future__ import annotations

import argparse

import torch
from nanoserve.bench.common import copy_bandwidth_gbs, emit, environment, graph_us

from nanoserve.kernels.fused_moe import MoeTiles, fused_experts, group_by_expert, select
from nanoserve.layers.moe import experts_loop


def loop_us(calls, repeats: int = 3) -> float:
    for call in calls[:2]:
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        start.record()
        for call in calls:
            call()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / len(calls))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024, 4096])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tiles", nargs="*", default=[], metavar="BM:BN:BK:WARPS:STAGES")
    parser.add_argument("--no-loop", action="store_true")
    args = parser.parse_args()
    e, h, i = args.experts, args.hidden, args.intermediate
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_ups = [torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=gen)
                .div_(h ** 0.5) for _ in range(args.layers)]
    downs = [torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=gen)
             .div_(i ** 0.5) for _ in range(args.layers)]
    bandwidth = copy_bandwidth_gbs()
    expert_bytes = 3 * h * i * 2
    for tokens in args.tokens:
        x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16, generator=gen)
        logits = torch.randn(tokens, e, device="cuda", generator=gen)
        weights, experts = torch.topk(torch.softmax(logits, -1), args.top_k, dim=-1)
        weights = weights.to(torch.bfloat16)
        touched = torch.unique(experts).numel()
        floor_us = touched * expert_bytes / (bandwidth * 1e3)
        pairs = tokens * args.top_k
        selected = (select(pairs, e, 2 * i, h, x.device), select(pairs, e, h, i, x.device))
        loop = None
        if not args.no_loop:
            loop = loop_us([lambda g=g, d=d: experts_loop(x, g, d, weights, experts)
                            for g, d in zip(gate_ups, downs)])
        group = graph_us([lambda: group_by_expert(experts, e, selected[0].block_m)])
        overrides = [MoeTiles(*map(int, t.split(":"))) for t in args.tiles]
        for up, down in [selected] + [(t, t) for t in overrides]:
            fused = graph_us([lambda g=g, d=d: fused_experts(x, g, d, weights, experts, up, down)
                              for g, d in zip(gate_ups, downs)])
            tiles = " ".join(":".join(map(str, t)) for t in (up, down))
            emit({"bench": "fused_moe", "tokens": tokens, "tiles": tiles,
                  "experts_touched": touched, "fused_us": round(fused, 2),
                  "group_us": round(group, 2), "loop_us": loop and round(loop, 1),
                  "floor_us": round(floor_us, 2), "fraction_of_floor": round(floor_us / fused, 3),
                  "bandwidth_gbs": round(bandwidth, 1), **environment()})


if __name__ == "__main__":
    main()
