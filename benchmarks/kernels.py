"""GPU microbenchmark of the Triton attention kernels on Qwen3-0.6B shapes (needs CUDA).

Each configuration is checked against ``paged_attention_reference`` (fp32 maths on the same
bf16 inputs), then timed with CUDA events around each call (L2 flushed before every call,
median of many), and printed as one JSON line. Decode is timed as a CUDA-graph replay, the way
the engine runs it, which also proves the decode path is capturable.

    python benchmarks/kernels.py [--quick] [--kernels decode prefill mixed]
        [--batches 16 64 96] [--decode-splits 1 2 4]
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nanoserve.attention.metadata import AttentionMetadata
from nanoserve.attention.torch_backend import paged_attention_reference
from nanoserve.kernels.common import device_sm_count
from nanoserve.kernels.decode_attention import decode_attention, num_decode_splits
from nanoserve.kernels.prefill_attention import prefill_attention, work_on_device
from nanoserve.kernels.prefill_attention import select as select_prefill
from nanoserve.runner.cuda_graph import context_caps

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128  # Qwen3-0.6B
DTYPE = torch.bfloat16
ELEM = 2  # bytes per bf16
L2_FLUSH_BYTES = 256 << 20  # well over the H100/H200 L2 (50-60 MB)
MAX_ABS_ERR = 2e-2  # bf16 inputs and output, fp32 accumulation
CAPTURE_MAX_SEQ_LEN = 40960  # the decode graphs' split count comes from the model's max length


def make_batch(seq_lens: list[int], q_lens: list[int], block_size: int,
               gen: torch.Generator, head_major: bool = False, scattered: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random q and paged K/V cache with every sequence's blocks scattered over the pool
    (without ``scattered``: each sequence's blocks in a row, as a fresh engine hands them out).

    The caches are ``[blocks, block_size, Hkv, D]`` views; with ``head_major`` their storage
    is ``[blocks, Hkv, block_size, D]``, so one KV head's keys of a block are contiguous."""
    dev = "cuda"
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks)
    perm = (torch.randperm(num_blocks, generator=gen, device=dev) if scattered
            else torch.arange(num_blocks, device=dev)).to(torch.int32)
    block_tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=dev)
    slots, start = [], 0
    for i, (n, q_len) in enumerate(zip(seq_lens, q_lens)):
        ids = perm[start:start + blocks[i]]
        block_tables[i, :blocks[i]] = ids
        pos = torch.arange(n - q_len, n, device=dev)
        slots.append(ids[pos // block_size].long() * block_size + pos % block_size)
        start += blocks[i]
    shape = (num_blocks, NUM_KV_HEADS, block_size, HEAD_DIM) if head_major else \
        (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device=dev, dtype=DTYPE)
    v_cache = torch.randn(shape, generator=gen, device=dev, dtype=DTYPE)
    if head_major:
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    q = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, generator=gen, device=dev, dtype=DTYPE)
    cum = torch.tensor([0, *q_lens], device=dev).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(query_start_loc=cum,
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
                             slot_mapping=torch.cat(slots), block_tables=block_tables,
                             max_query_len=max(q_lens), max_seq_len=max(seq_lens))
    return q, k_cache, v_cache, meta


def median_ms(fn: Callable[[], object], iters: int, warmup: int) -> float:
    """Median device time of ``fn`` from CUDA events, with L2 flushed before every call."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = (out.float() - ref.float())
    return {"max_abs_err": diff.abs().max().item(),
            "rel_err": (diff.norm() / ref.float().norm()).item(),
            "ok": bool(torch.isfinite(out).all()) and diff.abs().max().item() < MAX_ABS_ERR}


def reference(q, k_cache, v_cache, meta) -> torch.Tensor:
    # contiguous: the reference reads the caches through views of the engine's layout
    return paged_attention_reference(q.float(), k_cache.float().contiguous(),
                                     v_cache.float().contiguous(), meta, HEAD_DIM ** -0.5)


def kv_bytes(seq_lens: list[int]) -> int:
    return 2 * sum(seq_lens) * NUM_KV_HEADS * HEAD_DIM * ELEM


def causal_flops(seq_lens: list[int], q_lens: list[int]) -> int:
    """Multiply-adds of QK^T and PV over the visible (causal) keys, times two."""
    visible = sum(q * (n - q) + q * (q + 1) // 2 for n, q in zip(seq_lens, q_lens))
    return 4 * NUM_HEADS * HEAD_DIM * visible


def bench_decode(batch: int, ctx: int, block_size: int, iters: int, gen: torch.Generator,
                 splits: int | None = None) -> dict:
    """Uniform contexts; ``splits`` forces a split count, else the engine's rule for the decode
    graph that would run the batch (captured for the model's max length, or for batches up to
    8 the smallest context cap that holds ``ctx``)."""
    seq_lens = [ctx] * batch
    q, k_cache, v_cache, meta = make_batch(seq_lens, [1] * batch, block_size, gen)
    rule = splits is None
    if rule:
        cap = next(c for c in context_caps(batch, CAPTURE_MAX_SEQ_LEN) if c >= ctx)
        splits = num_decode_splits(batch, NUM_KV_HEADS, cap, device_sm_count(q.device))

    def run() -> torch.Tensor:
        return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                meta.query_start_loc, meta.max_seq_len, HEAD_DIM ** -0.5,
                                num_splits=splits)

    eager = run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = run()
    graph.replay()
    result = errors(eager, reference(q, k_cache, v_cache, meta))
    result["ok"] = result["ok"] and torch.equal(graphed, eager)
    ms = median_ms(graph.replay, iters, warmup=10)
    return {"kernel": "decode", "batch": batch, "ctx": ctx, "block_size": block_size,
            "num_splits": splits, "split_rule": rule, "ms": ms,
            "kv_gbps": kv_bytes(seq_lens) / ms / 1e6, **result}


def bench_prefill(seq_lens: list[int], q_lens: list[int], block_size: int, iters: int,
                  gen: torch.Generator, kind: str) -> dict:
    q, k_cache, v_cache, meta = make_batch(seq_lens, q_lens, block_size, gen)
    # The runner builds the work list with the step's inputs: outside the timed call here too.
    config = select_prefill(q.shape[1], k_cache.shape[2], q.shape[2], q.device)
    work = work_on_device(q_lens, seq_lens, q.shape[1], k_cache.shape[2], q.device, config)

    def run() -> torch.Tensor:
        return prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                 meta.query_start_loc, HEAD_DIM ** -0.5, work=work)

    result = errors(run(), reference(q, k_cache, v_cache, meta))
    ms = median_ms(run, iters, warmup=5)
    # For a mixed batch the reported context is the decodes' (the last sequences').
    row = {"kernel": kind, "batch": len(seq_lens), "ctx": seq_lens[-1], "q_len": max(q_lens),
           "block_size": block_size, "ms": ms, "kv_gbps": kv_bytes(seq_lens) / ms / 1e6,
           "tflops": causal_flops(seq_lens, q_lens) / ms / 1e9, **result}
    if kind == "prefill" and len(set(seq_lens)) == 1:
        row["sdpa_ms"] = sdpa_ms(len(seq_lens), seq_lens[0], iters, gen)
    return row


def sdpa_ms(batch: int, length: int, iters: int, gen: torch.Generator) -> float:
    """PyTorch's fused causal attention on the same shapes with contiguous K/V: a yardstick."""
    q = torch.randn(batch, NUM_HEADS, length, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE)
    k = torch.randn(batch, NUM_KV_HEADS, length, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    return median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                            enable_gqa=True), iters, warmup=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few shapes, fewer iterations")
    parser.add_argument("--kernels", nargs="+", default=["decode", "prefill", "mixed"],
                        choices=["decode", "prefill", "mixed"])
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--decode-splits", type=int, nargs="*", default=[],
                        help="also time decode at these forced split counts (besides the rule)")
    parser.add_argument("--batches", type=int, nargs="+", help="decode batch sizes to time")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels.py needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    iters = args.iters or (20 if args.quick else 100)
    batches = args.batches or ([1, 64] if args.quick else [1, 16, 64, 256])
    contexts = [512, 4096] if args.quick else [128, 512, 1024, 2048, 4096]
    block_sizes = [16] if args.quick else [16, 256]
    # Bounds on the reference's padded [B, H, max_q, max_kv] fp32 scores (GPU memory).
    max_prefill_tokens = 8192 if args.quick else 16384
    max_mixed_keys = 256 * 1024

    jobs: list[Callable[[], dict]] = []
    for bs in block_sizes:
        if "decode" in args.kernels:
            jobs += [lambda b=b, c=c, bs=bs, n=n: bench_decode(b, c, bs, iters, gen, n)
                     for b in batches for c in contexts for n in [None, *args.decode_splits]]
        if "prefill" in args.kernels:
            jobs += [lambda b=b, c=c, bs=bs: bench_prefill([c] * b, [c] * b, bs, iters, gen, "prefill")
                     for b in batches for c in contexts if b * c <= max_prefill_tokens]
            # Chunked prefill: the last 512-token chunk of a long prompt over its cached prefix.
            jobs += [lambda b=b, c=c, bs=bs: bench_prefill([c] * b, [512] * b, bs, iters, gen, "chunked")
                     for b in batches for c in contexts if c > 512 and b * 512 <= max_prefill_tokens]
        if "mixed" in args.kernels:  # continuous batching: one prompt chunk beside many decodes
            jobs += [lambda b=b, c=c, bs=bs: bench_prefill([512] + [c] * (b - 1), [512] + [1] * (b - 1),
                                                           bs, iters, gen, "mixed")
                     for b in batches if b > 1 for c in contexts if b * c <= max_mixed_keys]
    for job in jobs:
        row = job()
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
              flush=True)

if __name__ == "__main__":
    main()
