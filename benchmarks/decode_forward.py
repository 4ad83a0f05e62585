"""Decode forwards of the throughput workload under each projection GEMM (needs CUDA).

Replays every ``--stride``-th decode step of the throughput workload (its sequences' context
lengths) through the engine's model, KV cache and decode CUDA graphs, recaptured per variant:
cuBLAS, the batch GEMM (``kernels/batch_gemm.py``) at its default tiles, without its L2
prefetch, and at other tiles. The per-step times, weighted by the stride, estimate the decode
forward seconds of the whole run (the LM head and sampling are outside the graphs). First,
each variant's GEMM is checked against cuBLAS at the model's projection shapes.

    python benchmarks/decode_forward.py [--stride 64] [--shape qwen3-0.6b] [--quick]
"""
from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from common import SHAPES, emit, environment, make_model_dir
from decode_workload import decode_steps
from stream_split_decode import decode_inputs, timed_ms

import nanoserve.kernels.batch_gemm as batch_gemm
import nanoserve.layers.linear as linear_layer
from nanoserve import LLM
from nanoserve.kernels.batch_gemm import BatchGemmConfig, batch_linear
from nanoserve.runner.cuda_graph import DecodeGraphs

ROWS = (2, 16, 64, 130, 256)


@contextlib.contextmanager
def patched(module, name: str, value) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def tiles(block_n: int, block_k: int, warps: int, stages: int, block_m_max: int = 64
          ) -> Callable[[int, int, int, torch.device], BatchGemmConfig]:
    def config(n: int, k: int, rows: int, device: torch.device) -> BatchGemmConfig:
        block_m = min(max(1 << (rows - 1).bit_length(), 16), block_m_max)
        return BatchGemmConfig(block_m, block_n, block_k, warps, stages)
    return config


def variants(quick: bool) -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    out = {
        "cublas": lambda: patched(linear_layer, "use_batch_gemm", lambda x, bias: False),
        "batch_gemm": contextlib.nullcontext,
        "no_prefetch": lambda: patched(batch_gemm, "prefetch_plan", lambda *a, **k: (0, 0)),
    }
    if not quick:
        for spec in [(32, 128, 4, 4), (64, 64, 4, 4), (64, 128, 4, 4), (128, 64, 4, 3),
                     (64, 64, 4, 3, 128), (128, 64, 8, 3, 128)]:
            out["tiles_" + "_".join(map(str, spec))] = \
                lambda spec=spec: patched(batch_gemm, "default_config", tiles(*spec))
    return out


def check_gemms(shape: dict, make_context: Callable[[], contextlib.AbstractContextManager]
                ) -> float:
    """Largest error relative to cuBLAS's output scale over the model's projections."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], \
        shape["num_key_value_heads"] * shape["head_dim"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    worst = 0.0
    with make_context():
        for n, k in [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]:
            w = torch.randn(n, k, generator=gen, device="cuda").div(k ** 0.5).bfloat16()
            for rows in ROWS:
                x = torch.randn(rows, k, generator=gen, device="cuda").bfloat16()
                ref = F.linear(x.float(), w.float())
                err = (batch_linear(x, w).float() - ref).abs().max() / ref.abs().max()
                worst = max(worst, err.item())
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--stride", type=int, default=64)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(make_model_dir(args.shape, Path(tmp) / "m")), load_format="dummy",
                  max_num_seqs=256, enforce_eager=True)
    runner = llm.engine.executor
    width = -(-runner.max_model_len // runner.block_size)
    graphs, errors = {}, {}
    for name, make_context in variants(args.quick).items():
        errors[name] = check_gemms(SHAPES[args.shape], make_context)
        with make_context():
            graphs[name] = DecodeGraphs(runner.model, 256, width, runner.max_model_len,
                                        runner.device)
    totals = dict.fromkeys(graphs, 0.0)
    with torch.inference_mode():
        for step, seq_lens in zip(range(0, 10 ** 9, args.stride), decode_steps(args.stride)):
            batch, _ = decode_inputs(seq_lens, 1, runner.block_size,
                                     runner.model_config.vocab_size)
            record = {"bench": "decode_forward_step", "step": step, "num_seqs": len(seq_lens),
                      "mean_ctx": round(sum(seq_lens) / len(seq_lens))}
            for name, g in graphs.items():
                ms = timed_ms(lambda g=g: g.run(*batch))
                record[name] = round(ms, 4)
                totals[name] += ms * args.stride / 1e3
            emit(record)
    for name in sorted(totals, key=totals.get):
        emit({"bench": "decode_forward", "variant": name, "shape": args.shape,
              "forward_seconds": round(totals[name], 3), "stride": args.stride,
              "gemm_max_rel_error": round(errors[name], 5), **environment()})


if __name__ == "__main__":
    main()
