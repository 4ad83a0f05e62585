"""Host time of the first eager GEMM at each row count, in a freshly built engine (needs CUDA).
One JSON line: per row count, the first call's and the second call's ms (each timed from an idle
device to the end of its GEMM), and the totals.

The throughput workload's first run pays 9-35 ms in single LM-head calls of its admitting steps
(run 161, ``admit_profile.py --compare``), at row counts its second run meets again for 0.04 ms.
``--gemm projections`` times a layer's four projections instead, at token counts an eager
prefill step may have (run 165: o_proj's first call at 12,823 tokens took 32 ms of host time);
``--ladder STEP`` first calls each of them at every multiple of 16 up to 512 and of STEP up to
16384, to see whether such a ladder at start-up loads the kernels of the sizes between.

    python benchmarks/first_gemm_calls.py [--rows 1 256]
    python benchmarks/first_gemm_calls.py --gemm projections [--ladder 256]
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
    parser.add_argument("--gemm", choices=["lm_head", "projections"], default="lm_head")
    parser.add_argument("--ladder", type=int, default=0, metavar="STEP")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(make_model_dir("qwen3-0.6b", Path(tmp) / "m")), load_format="dummy",
                  max_num_seqs=256)
    if args.gemm == "projections":
        projections(llm.engine.executor.model.model.layers[0], args.ladder)
        return
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


PROBE_TOKENS = (12823, 9001, 5555, 14321, 3001, 7777, 11111, 15000, 2049, 777, 333, 123)


def projections(layer: torch.nn.Module, ladder: int) -> None:
    weights = {"qkv": layer.self_attn.qkv_proj.weight, "o": layer.self_attn.o_proj.weight,
               "gate_up": layer.mlp.gate_up_proj.weight, "down": layer.mlp.down_proj.weight}
    # One input per width, so that every call's rows are a contiguous slice as in the engine.
    xs = {w.shape[1]: torch.randn(16384, w.shape[1], device="cuda", dtype=w.dtype)
          for w in weights.values()}
    ladder_ms = 0.0
    if ladder:
        sizes = list(range(16, 512, 16)) + list(range(512, 16385, ladder))
        ladder_ms = sum(call_ms(lambda: F.linear(xs[w.shape[1]][:m], w))
                        for w in weights.values() for m in sizes)
    rows = []
    for m in PROBE_TOKENS:
        for name, w in weights.items():
            inputs = xs[w.shape[1]][:m]
            first = call_ms(lambda: F.linear(inputs, w))
            rows.append({"tokens": m, "gemm": name, "first_ms": round(first, 3),
                         "second_ms": round(call_ms(lambda: F.linear(inputs, w)), 3)})
    slow = [r for r in rows if r["first_ms"] > r["second_ms"] + 1.0]
    emit({"bench": "first_gemm_calls", "gemm": "projections", "ladder_step": ladder,
          "ladder_ms": round(ladder_ms, 1), "num_slow_first": len(slow), "slow_first": slow,
          "first_ms_total": round(sum(r["first_ms"] for r in rows), 1),
          "second_ms_total": round(sum(r["second_ms"] for r in rows), 1), **environment()})


if __name__ == "__main__":
    main()
