"""Host time of the first eager LM-head GEMM at each row count, in a freshly built engine (needs
CUDA). One JSON line: per row count, the first call's and the second call's ms (each timed
from an idle device to the end of its GEMM), and the totals.

The throughput workload's first run pays 9-35 ms in single LM-head calls of its admitting steps
(run 161, ``admit_profile.py --compare``), at row counts its second run meets again for 0.04 ms.

    python benchmarks/first_gemm_calls.py [--rows 1 256]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import emit, environment, make_model_dir

from nanoserve import LLM


def call_ms(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs=2, default=[1, 256], metavar=("FIRST", "LAST"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(make_model_dir("qwen3-0.6b", Path(tmp) / "m")), load_format="dummy",
                  max_num_seqs=256)
    weight = llm.engine.executor.model.lm_head.weight
    x = torch.randn(args.rows[1], weight.shape[1], device="cuda", dtype=weight.dtype)
    first, second = {}, {}
    for m in range(args.rows[0], args.rows[1] + 1):
        rows = x[:m].contiguous()
        first[m] = round(call_ms(lambda: F.linear(rows, weight)), 3)
        second[m] = round(call_ms(lambda: F.linear(rows, weight)), 3)
    slow = {m: t for m, t in first.items() if t > 1.0}
    emit({"bench": "first_gemm_calls", "gemm": "lm_head",
          "first_ms_total": round(sum(first.values()), 1),
          "second_ms_total": round(sum(second.values()), 1), "num_slow_first": len(slow),
          "slow_first_ms": slow, "second_ms_max": max(second.values()), **environment()})


if __name__ == "__main__":
    main()
