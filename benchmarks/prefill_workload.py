"""Prefill attention over the throughput workload's admitting steps, per tile choice (needs CUDA).

The throughput run prefills its 256 prompts (100-1024 tokens) in steps of up to
``--budget`` tokens that also decode the requests already admitted. This rebuilds those
steps' batches (the scheduler's order: running decodes first, then prompts in turn, the last
one chunked), checks the kernel against the fp32 reference at the default tiles, times each
tile choice (L2 flushed before every call) and reports the estimated prefill-attention seconds
of the whole run (x the model's 28 layers). One JSON line per tile choice.

    python benchmarks/prefill_workload.py [--budget 16384] [--default-tiles]
"""
from __future__ import annotations

import argparse
import contextlib
import json

import torch
from kernels import HEAD_DIM, errors, make_batch, median_ms, reference
from throughput import workload

import nanoserve.kernels.prefill_attention as prefill
from nanoserve.kernels.prefill_attention import prefill_attention

LAYERS = 28  # Qwen3-0.6B
# (BLOCK_M, BLOCK_N, warps, stages); the first is the default.
TILES = [(prefill.BLOCK_M, prefill.BLOCK_N, prefill.NUM_WARPS, prefill.NUM_STAGES),
         (64, 64, 4, 2), (64, 64, 8, 3), (64, 32, 4, 3), (64, 128, 4, 3), (64, 128, 8, 3),
         (128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 3), (256, 64, 8, 3)]


def admitting_steps(budget: int, max_num_seqs: int = 256) -> list[tuple[list[int], list[int]]]:
    """(seq_lens, q_lens) of each step until every prompt is prefilled."""
    prompts, _ = workload()
    lengths = [len(p) for p in prompts]
    decoding: list[int] = []  # context length of each admitted, fully prefilled request
    steps, i, done = [], 0, 0
    while i < len(lengths):
        seq_lens, q_lens, room = [], [], budget
        for j, ctx in enumerate(decoding):
            decoding[j] = ctx + 1
            seq_lens.append(ctx + 1)
            q_lens.append(1)
            room -= 1
        while i < len(lengths) and room > 0 and len(decoding) < max_num_seqs:
            n = min(lengths[i] - done, room)
            seq_lens.append(done + n)
            q_lens.append(n)
            room -= n
            done += n
            if done == lengths[i]:
                decoding.append(lengths[i])
                i, done = i + 1, 0
        steps.append((seq_lens, q_lens))
    return steps


@contextlib.contextmanager
def tiles(block_m: int, block_n: int, warps: int, stages: int):
    saved = prefill.BLOCK_M, prefill.BLOCK_N, prefill.NUM_WARPS, prefill.NUM_STAGES
    prefill.BLOCK_M, prefill.BLOCK_N, prefill.NUM_WARPS, prefill.NUM_STAGES = \
        block_m, block_n, warps, stages
    try:
        yield
    finally:
        prefill.BLOCK_M, prefill.BLOCK_N, prefill.NUM_WARPS, prefill.NUM_STAGES = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=16384)
    parser.add_argument("--default-tiles", action="store_true",
                        help="time the default tiles only")
    args = parser.parse_args()
    choices = TILES[:1] if args.default_tiles else TILES
    gen = torch.Generator(device="cuda").manual_seed(0)
    seconds = dict.fromkeys(choices, 0.0)
    oks = dict.fromkeys(choices, True)
    flops = 0.0
    steps = admitting_steps(args.budget)
    for seq_lens, q_lens in steps:
        q, k_cache, v_cache, meta = make_batch(seq_lens, q_lens, 16, gen)
        ref = reference(q, k_cache, v_cache, meta)
        # Causal: query i of a chunk starting at position p sees p + i + 1 keys.
        flops += sum(4 * HEAD_DIM * q.shape[1] * (q_len * (s - q_len) + q_len * (q_len + 1) / 2)
                     for s, q_len in zip(seq_lens, q_lens))
        for tile in choices:
            with tiles(*tile):
                work = prefill.work_on_device(q_lens, seq_lens, q.shape[1], k_cache.shape[2],
                                              q.device)

                def run() -> torch.Tensor:
                    return prefill_attention(q, k_cache, v_cache, meta.block_tables,
                                             meta.seq_lens, meta.query_start_loc,
                                             HEAD_DIM ** -0.5, work=work)
                try:
                    oks[tile] = oks[tile] and errors(run(), ref)["ok"]
                    seconds[tile] += median_ms(run, iters=10, warmup=2) * LAYERS / 1e3
                except Exception as exc:  # noqa: BLE001 - a tiling past the SM's shared memory
                    seconds[tile] = float("inf")
                    print(json.dumps({"tiles": tile, "error": type(exc).__name__}), flush=True)
        del q, k_cache, v_cache, meta, ref
        torch.cuda.empty_cache()
    for tile, s in sorted(seconds.items(), key=lambda kv: kv[1]):
        print(json.dumps({"bench": "prefill_workload", "budget": args.budget,
                          "steps": len(steps), "block_m": tile[0], "block_n": tile[1],
                          "num_warps": tile[2], "num_stages": tile[3],
                          "default": tile == TILES[0], "seconds": round(s, 4),
                          "tflops": round(flops * LAYERS / s / 1e12, 1) if s else None,
                          "ok": oks[tile]}), flush=True)


if __name__ == "__main__":
    main()
