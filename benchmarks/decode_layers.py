"""The persistent batch-1 decode kernel (persistent_layers.py, an experiment) at real shapes,
random bf16 weights: first checks (the persistent launch equals the phase-by-phase launches
bit for bit; no barrier timed out), then times the whole layer stack per forward in a CUDA
graph, for each tiling asked for. One JSON line per shape and tiling:

    python benchmarks/decode_layers.py --shape qwen3-0.6b [--context 256] [--sweep] [--profile]
"""
from __future__ import annotations

import argparse

import torch

from common import SHAPES, copy_bandwidth_gbs, emit, environment, replay_ms

from persistent_layers import DecodeStep, LayerTiles, LayerWeights, decode_layers

BLOCK_SIZE = 16  # the engine's default

SWEEP_8B = [
    LayerTiles(qkv=8, o=4, gate_up=8, down=2),
    LayerTiles(qkv=4, o=4, gate_up=4, down=2),
    LayerTiles(qkv=8, o=4, gate_up=8, down=2, num_warps=8),
]

SWEEP = [
    LayerTiles(),
    LayerTiles(qkv=16),
    LayerTiles(num_splits=8),
    LayerTiles(attn_block_n=32),
    LayerTiles(programs=128),
    LayerTiles(qkv=16, o=8, gate_up=16, down=8, num_warps=4),
    LayerTiles(num_warps=4),
    LayerTiles(gate_up=64, num_warps=16),
]
PHASE_NAMES = ["qkv", "attention", "o_proj", "gate_up", "down_proj"]


def random_stack(shape: dict, context: int) -> tuple:
    """Weights, caches, step inputs and RoPE table for one sequence of ``context`` tokens."""
    hidden, inter, layers = shape["hidden_size"], shape["intermediate_size"], \
        shape["num_hidden_layers"]
    heads, kv_heads, head_dim = shape["num_attention_heads"], shape["num_key_value_heads"], \
        shape["head_dim"]
    bf16 = dict(dtype=torch.bfloat16, device="cuda")

    def w(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, **bf16) * dims[-1] ** -0.5

    weights = LayerWeights(qkv=w(layers, (heads + 2 * kv_heads) * head_dim, hidden),
                           o=w(layers, hidden, heads * head_dim),
                           gate_up=w(layers, 2 * inter, hidden), down=w(layers, hidden, inter),
                           q_norm=1 + 0.1 * torch.randn(layers, head_dim, **bf16),
                           k_norm=1 + 0.1 * torch.randn(layers, head_dim, **bf16))
    num_blocks = context // BLOCK_SIZE + 8
    k_cache = torch.randn(layers, num_blocks, BLOCK_SIZE, kv_heads, head_dim, **bf16)
    v_cache = torch.randn_like(k_cache)
    block_table = torch.randperm(num_blocks, device="cuda")[:-(-context // BLOCK_SIZE)]
    last = context - 1
    slot = int(block_table[last // BLOCK_SIZE]) * BLOCK_SIZE + last % BLOCK_SIZE
    step = DecodeStep(block_table=block_table.to(torch.int32),
                      seq_len=torch.tensor([context], dtype=torch.int32, device="cuda"),
                      position=torch.tensor([last], device="cuda"),
                      slot=torch.tensor([slot], device="cuda"))
    inv_freq = 1.0 / (shape["rope_theta"] ** (torch.arange(0, head_dim, 2, device="cuda")
                                               / head_dim))
    angles = torch.arange(context + 8, device="cuda")[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(torch.bfloat16)
    return weights, k_cache, v_cache, step, cos_sin


def run(shape_name: str, context: int, tilings: list[LayerTiles], bandwidth: float,
        profile: bool) -> None:
    shape = SHAPES[shape_name]
    weights, k_cache, v_cache, step, cos_sin = random_stack(shape, context)
    eps = shape["rms_norm_eps"]
    scale = shape["head_dim"] ** -0.5
    h0 = torch.randn(shape["hidden_size"], dtype=torch.bfloat16, device="cuda")
    layer_bytes = sum(t.numel() * t.element_size() for t in weights[:4])
    for tiles in tilings:
        record = {"bench": "decode_layers", "shape": shape_name, "context": context,
                  **tiles._asdict()}
        # Persistent against phase by phase, from the same inputs: the same arithmetic, so the
        # same bits, unless a barrier let a program read before its producers finished.
        outs = []
        for persistent in (False, True):
            h, kc, vc = h0.clone(), k_cache.clone(), v_cache.clone()
            sync = decode_layers(h, weights, kc, vc, step, cos_sin, eps, eps, scale, tiles,
                                 persistent=persistent)
            torch.cuda.synchronize()
            outs.append((h, kc, vc, int(sync[1])))
        (h_a, kc_a, vc_a, _), (h_b, kc_b, vc_b, timed_out) = outs
        record.update(timed_out=bool(timed_out), h_equal=bool(torch.equal(h_a, h_b)),
                      cache_equal=bool(torch.equal(kc_a, kc_b) and torch.equal(vc_a, vc_b)),
                      h_max_diff=float((h_a.float() - h_b.float()).abs().max()),
                      h_finite=bool(h_b.isfinite().all()))
        del kc_a, vc_a, kc_b, vc_b
        h = h0.clone()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            decode_layers(h, weights, k_cache, v_cache, step, cos_sin, eps, eps, scale, tiles)
            with torch.cuda.graph(graph):
                sync = decode_layers(h, weights, k_cache, v_cache, step, cos_sin, eps, eps,
                                     scale, tiles)
        torch.cuda.synchronize()
        ms = replay_ms(graph, 50)
        record.update(forward_ms=round(ms, 4),
                      floor_ms=round(layer_bytes / bandwidth / 1e6, 4),
                      us_per_layer=round(ms * 1e3 / shape["num_hidden_layers"], 2),
                      timed_out_in_graph=bool(int(sync[1])))
        emit(record)
        del graph
        if profile:
            emit({"bench": "decode_layers_profile", "shape": shape_name, "context": context,
                  "tiles": tiles._asdict(),
                  **phase_profile(h0.clone(), weights, k_cache, v_cache, step, cos_sin, eps,
                                  scale, tiles, shape["num_hidden_layers"])})


def phase_profile(h: torch.Tensor, weights: LayerWeights, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, step: DecodeStep, cos_sin: torch.Tensor, eps: float,
                  scale: float, tiles: LayerTiles, num_layers: int) -> dict:
    """Per phase, averaged over the layers but the last (microseconds): ``span``, from the
    first program starting it to the first starting the next; ``work_max`` and
    ``work_median``, a program's start to its arrival at the barrier; ``barrier``, from the
    last arrival to the first program starting the next phase."""
    from nanoserve.kernels.common import device_sm_count

    programs = tiles.programs or device_sm_count(h.device)
    stamps = torch.zeros(num_layers * 10, programs, dtype=torch.int64, device="cuda")
    for _ in range(3):  # the last run's clocks
        decode_layers(h, weights, k_cache, v_cache, step, cos_sin, eps, eps, scale, tiles,
                      stamps=stamps)
    torch.cuda.synchronize()
    t = stamps.view(num_layers, 5, 2, programs).double() / 1e3
    start, end = t[:, :, 0], t[:, :, 1]
    next_start = torch.cat([start[:, 1:], torch.roll(start[:, :1], -1, dims=0)], dim=1)
    keep = slice(0, num_layers - 1)
    span = next_start.min(-1).values - start.min(-1).values
    barrier = next_start.min(-1).values - end.max(-1).values
    work = end - start
    out = {"layer_us": round(float((start[1:, 0].min(-1).values
                                    - start[:-1, 0].min(-1).values).mean()), 2)}
    for p, name in enumerate(PHASE_NAMES):
        out[f"phase_{name}"] = {"span": round(float(span[keep, p].mean()), 2),
                     "work_max": round(float(work[keep, p].max(-1).values.mean()), 2),
                     "work_median": round(float(work[keep, p].median(-1).values.mean()), 2),
                     "barrier": round(float(barrier[keep, p].mean()), 2),
                     "start_spread": round(float((start[keep, p].max(-1).values
                                                  - start[keep, p].min(-1).values).mean()), 2)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", nargs="+", default=["qwen3-0.6b"])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--sweep", action="store_true", help="every tiling in SWEEP")
    parser.add_argument("--profile", action="store_true",
                        help="also each phase's time, from the GPU clock")
    args = parser.parse_args()
    bandwidth = copy_bandwidth_gbs()
    emit({"bench": "decode_layers_env", **environment(), "copy_bandwidth_gbs": round(bandwidth)})
    for shape in args.shape:
        sweep = SWEEP_8B if shape == "qwen3-8b" else SWEEP
        run(shape, args.context, sweep if args.sweep else sweep[:1], bandwidth, args.profile)


if __name__ == "__main__":
    main()
