"""NCCL all-reduce time at decode sizes, and what it costs a decode step. One JSON line per size.

A tensor-parallel decode step all-reduces the hidden states twice per layer (after the
attention output and the MLP down projection), so per-step time = 2 x layers x t(batch).
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, port: int, hidden: int, layers: int, batches: list[int],
            iters: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    for batch in batches:
        x = torch.randn(batch, hidden, dtype=torch.bfloat16, device="cuda")
        for _ in range(20):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dist.all_reduce(x)
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) / iters * 1e3
        if rank == 0:
            print(json.dumps({"bench": "allreduce", "world_size": world, "batch": batch,
                              "hidden": hidden, "us": round(us, 2),
                              "per_decode_step_ms": round(2 * layers * us / 1e3, 3)}),
                  flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-size", type=int, default=torch.cuda.device_count())
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--port", type=int, default=29533)
    args = parser.parse_args()
    mp.spawn(_worker, args=(args.world_size, args.port, args.hidden, args.layers,
                            [1, 8, 64, 256], args.iters), nprocs=args.world_size)


if __name__ == "__main__":
    main()
