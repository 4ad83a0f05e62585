"""Probes of why a process's first timed throughput run is 1-2% slower than the ones after it
(docs/benchmarks.md, runs 119-126): options of ``throughput.py`` that prepare the engine, the
host or the card before the runs. None of them removed the difference; they stay so that the
measurements can be repeated.
"""
from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn.functional as F

from nanoserve import LLM, SamplingParams


def add_probe_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-order", choices=("as-left", "sorted", "shuffled"),
                        default="as-left",
                        help="order of the free KV blocks before each run: as the engine left "
                             "them, ascending ids (a fresh engine's), or a random permutation")
    parser.add_argument("--warm-pinned", action="store_true",
                        help="before the runs, have the host allocator cache pinned blocks of "
                             "every power-of-two size from 512 B to 16 MB")
    parser.add_argument("--warm-gemms", action="store_true",
                        help="before the runs, call each projection's and the LM head's GEMM "
                             "at the row counts eager steps may have (cuBLAS loads kernels on "
                             "their first use)")
    parser.add_argument("--warm-run", action="store_true",
                        help="before the runs, generate 4 tokens for 32 prompts of 1024 ids "
                             "(two full prefill steps), then reset the prefix cache")
    parser.add_argument("--warm-gpu", type=float, default=0.0, metavar="SECONDS",
                        help="keep the GPU busy with matmuls for this long right before the "
                             "runs (clock and power ramp-up)")


def probe_fields(args: argparse.Namespace) -> dict:
    """The probes' settings, for each run's JSON record."""
    return {"block_order": args.block_order, "warm_pinned": args.warm_pinned,
            "warm_gemms": args.warm_gemms, "warm_run": args.warm_run,
            "warm_gpu_seconds": args.warm_gpu}


def before_runs(llm: LLM, args: argparse.Namespace) -> None:
    if args.warm_pinned:
        # Four of each size live at once; freed, they stay in the allocator's cache.
        pinned = [torch.empty(1 << p, dtype=torch.uint8, pin_memory=True)
                  for p in range(9, 25) for _ in range(4)]
        pinned.clear()
    if args.warm_run:
        rng = random.Random(1)
        llm.generate([[rng.randint(0, 10000) for _ in range(1024)] for _ in range(32)],
                     SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=4),
                     use_tqdm=False)
        assert llm.reset_prefix_cache()
    if args.warm_gemms:
        warm_gemms(llm)
    if args.warm_gpu:
        busy_gpu(args.warm_gpu)


def before_each_run(llm: LLM, args: argparse.Namespace) -> None:
    """Reorder the free list (every block free) for a probe of physical KV placement."""
    bm = llm.engine.block_manager
    if args.block_order == "as-left":
        return
    assert bm.num_free_blocks == bm.num_blocks, "every request of the last run has finished"
    ids = list(range(bm.num_blocks))
    if args.block_order == "shuffled":
        random.Random(1).shuffle(ids)
    bm.free.clear()
    bm.free.update((i, None) for i in ids)


@torch.inference_mode()
def warm_gemms(llm: LLM) -> None:
    """F.linear at every row count up to max_num_seqs for the LM head, and at every 64th (and
    one more) up to the step budget for the layers' projections."""
    budget = llm.engine.scheduler.max_num_batched_tokens
    model = llm.engine.executor.model
    layer = model.model.layers[0]
    weights = [layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight,
               layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight]
    x = torch.randn(budget + 1, max(w.shape[1] for w in weights + [model.lm_head.weight]),
                    device="cuda", dtype=torch.bfloat16)
    for m in range(1, llm.engine.config.max_num_seqs + 1):
        F.linear(x[:m, :model.lm_head.weight.shape[1]].contiguous(), model.lm_head.weight)
    for m in sorted({r for m in range(64, budget + 1, 64) for r in (m, m + 1)}):
        for w in weights:
            F.linear(x[:m, :w.shape[1]].contiguous(), w)
    torch.cuda.synchronize()


def busy_gpu(seconds: float) -> None:
    """bf16 matmuls back to back for ``seconds`` of wall time."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
