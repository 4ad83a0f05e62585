"""Decode forwards of the throughput workload, one CUDA graph per step against the batch split
in parts replayed on parallel streams (needs CUDA). One JSON line per step, then totals.

At 16-256 rows a decode step's projections and small kernels leave the memory system idle
(each is a few-µs launch over a few MB), while its attention kernels stream K/V at the copy
bandwidth. Two independent halves of the batch on two streams can overlap one half's
projections with the other's attention. This replays every ``--stride``-th decode step of the
throughput workload (its sequences' context lengths, on the engine's model and KV cache) and
times the forward both ways; the per-step times, weighted by the stride, estimate the forward
seconds of the whole run.

    python benchmarks/stream_split_decode.py [--stride 64] [--shape qwen3-0.6b]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
from common import SHAPES, emit, environment, make_model_dir, timed_ms
from decode_workload import decode_steps

from nanoserve import LLM
from nanoserve.runner.cuda_graph import DecodeGraphs
from nanoserve.runner.graph_inputs import DecodeRows


def decode_inputs(seq_lens: list[int], first_block: int, block_size: int, vocab: int
                  ) -> tuple[DecodeRows, int]:
    """A decode batch over contiguous fresh blocks from ``first_block``; also the next free one."""
    tables, slots, block = [], [], first_block
    width = -(-max(seq_lens) // block_size)
    for n in seq_lens:
        blocks = -(-n // block_size)
        tables.append(list(range(block, block + blocks)) + [0] * (width - blocks))
        slots.append((block + (n - 1) // block_size) * block_size + (n - 1) % block_size)
        block += blocks
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__, reverse=True)
    rows = DecodeRows(token_ids=np.random.randint(0, vocab, len(seq_lens)).astype(np.int64),
                      sample_rows=np.full(len(seq_lens), -1, dtype=np.int64),
                      positions=np.array([n - 1 for n in seq_lens], dtype=np.int64),
                      slots=np.array(slots, dtype=np.int64),
                      seq_lens=np.array(seq_lens, dtype=np.int32),
                      order=np.array(order, dtype=np.int32),
                      tables=np.array(tables, dtype=np.int32))
    return rows, block


def split(seq_lens: list[int], parts: int) -> list[list[int]]:
    """Deal the sequences, longest first, to ``parts`` parts in a snake (equal K/V bytes)."""
    out: list[list[int]] = [[] for _ in range(parts)]
    for i, n in enumerate(sorted(seq_lens, reverse=True)):
        lap, j = divmod(i, parts)
        out[j if lap % 2 == 0 else parts - 1 - j].append(n)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--stride", type=int, default=64)
    parser.add_argument("--presorted", action="store_true",
                        help="rows in longest-first order already (batch order = the kernel's)")
    parser.add_argument("--parts", type=int, nargs="*", default=[2, 4],
                        help="parts to split the batch into (none: the whole batch only)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(make_model_dir(args.shape, Path(tmp) / "m")), load_format="dummy",
                  max_num_seqs=256)
    runner = llm.engine.executor
    dev, block_size = runner.device, runner.block_size
    width = runner.graphs.max_blocks
    vocab = runner.model_config.vocab_size
    # Forwards alone (the engine's graphs also run the LM head and sampler); one set of static
    # buffers and graphs per stream.
    whole = DecodeGraphs(runner.model, 256, width, runner.max_model_len, dev)
    split_graphs = {p: [DecodeGraphs(runner.model, -(-256 // p), width, runner.max_model_len, dev)
                        for _ in range(p)] for p in args.parts}
    # (name, parts, mode): mode "serial" replays the parts one after another on one stream.
    variants = [("one", 1, "serial")] + [
        (f"{p}x_{mode}", p, mode) for p in args.parts for mode in ("serial", "streams", "prio")]
    streams = {name: [torch.cuda.Stream(priority=-1 if mode == "prio" and i == 0 else 0)
                      for i in range(p)] for name, p, mode in variants}
    totals = {name: 0.0 for name, _, _ in variants}
    main_stream = torch.cuda.current_stream()
    with torch.inference_mode():
        for step, seq_lens in zip(range(0, 10 ** 9, args.stride), decode_steps(args.stride)):
            if args.presorted:
                seq_lens = sorted(seq_lens, reverse=True)
            batch, _ = decode_inputs(seq_lens, 1, block_size, vocab)
            parted = {}
            for p in (p for p in args.parts if p <= len(seq_lens)):
                first, parted[p] = 1, []
                for lens in split(seq_lens, p):
                    inputs, first = decode_inputs(lens, first, block_size, vocab)
                    parted[p].append(inputs)
            record = {"bench": "stream_split_decode_step", "step": step,
                      "num_seqs": len(seq_lens),
                      "mean_ctx": round(sum(seq_lens) / len(seq_lens))}
            for name, p, mode in variants:
                if p > len(seq_lens):
                    continue
                if p == 1:
                    def run() -> None:
                        whole.run(batch)
                else:
                    def run(p: int = p, name: str = name, mode: str = mode) -> None:
                        for graphs, stream, inputs in zip(split_graphs[p], streams[name],
                                                          parted[p]):
                            if mode == "serial":
                                graphs.run(inputs)
                                continue
                            stream.wait_stream(main_stream)
                            with torch.cuda.stream(stream):
                                graphs.run(inputs)
                        if mode != "serial":
                            for stream in streams[name]:
                                main_stream.wait_stream(stream)
                ms = timed_ms(run)
                record[name] = round(ms, 4)
                totals[name] += ms * args.stride / 1e3
            emit(record)
    emit({"bench": "stream_split_decode", "shape": args.shape, "stride": args.stride,
          "forward_seconds": {k: round(v, 3) for k, v in totals.items()}, **environment()})


if __name__ == "__main__":
    main()
