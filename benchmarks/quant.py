"""Quantized weights against 16-bit ones: batch-1 ms per token and throughput, one JSON line each.

GPU mode (default): for each ``--shapes`` shape, random weights (``load_format="dummy"``) in
bf16, fp8 (``quantization="fp8"``: per-channel weights, per-token activations, torch._scaled_mm)
and int4 (AWQ's layout, group size 128: the int4 GEMV, GEMM or dequantized cuBLAS by rows;
``--variants`` picks some); ``ms_per_token`` is
(t(N tokens) - t(1 token)) / (N - 1) at a short prompt, each t the best of the repeats;
``throughput_tok_s`` is output tokens per second over ``--num-prompts`` random prompts.
CPU mode (``--cpu``): the packaged SmolLM2-135M Q4_1 GGUF kept quantized against dequantized
at load (``quantization="none"``): single-sequence decode tokens/s and 32-prompt throughput.

    python benchmarks/quant.py --shapes qwen3-8b qwen3-0.6b
    python benchmarks/quant.py --cpu
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from nanoserve.bench.common import (emit, environment, free_device_memory, run_shapes,
                                    timed_generate)
from nanoserve.bench.latency import time_decode
from nanoserve.bench.shapes import make_model_dir

from nanoserve import LLM, SamplingParams

VARIANTS = ("bf16", "fp8", "int4-awq")
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm",
              "zero_point": True}


def measure(llm: LLM, device: str, vocab: int, args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    prompt = [rng.randrange(vocab) for _ in range(args.context)]
    ms = time_decode(llm, prompt, args.new_tokens, args.repeats, device).ms_per_token
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)]
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    seconds, tokens = timed_generate(llm, prompts, params, device)
    return {"ms_per_token": round(ms, 4), "decode_tok_s": round(1e3 / ms, 1) if ms > 0 else None,
            "throughput_tok_s": round(tokens / seconds, 1), "num_prompts": args.num_prompts,
            "prompt_len": args.prompt_len, "output_len": args.output_len}


def run_gpu_shape(name: str, args: argparse.Namespace, env: dict, tmp: Path) -> None:
    for variant in args.variants:
        folder = make_model_dir(name, tmp / f"{name}-{variant}", num_hidden_layers=args.layers)
        config = json.loads((folder / "config.json").read_text())
        if variant == "int4-awq":
            (folder / "config.json").write_text(json.dumps(
                {**config, "quantization_config": AWQ_CONFIG}))
        t0 = time.perf_counter()
        llm = LLM(str(folder), load_format="dummy", dtype="bfloat16",
                  max_num_seqs=args.max_num_seqs,
                  quantization="fp8" if variant == "fp8" else "auto")
        load_s = time.perf_counter() - t0
        try:
            record = measure(llm, "cuda", min(config["vocab_size"], 10000), args)
        finally:
            llm.close()
            del llm
            free_device_memory()
        emit({"bench": "quant", "shape": name, "weights": variant, **record,
              "load_seconds": round(load_s, 1), **env})


def run_cpu(args: argparse.Namespace, env: dict) -> None:
    for quantization in ("auto", "none"):
        t0 = time.perf_counter()
        llm = LLM(device="cpu", dtype="float32", quantization=quantization,
                  max_num_seqs=args.num_prompts)
        load_s = time.perf_counter() - t0
        try:
            record = measure(llm, "cpu", 10000, args)
        finally:
            llm.close()
        emit({"bench": "quant-cpu", "model": "SmolLM2-135M-Instruct.Q4_1.gguf",
              "weights": "kept Q4_1" if quantization == "auto" else "dequantized fp32",
              **record, "load_seconds": round(load_s, 1), **env})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3-8b"])
    parser.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    parser.add_argument("--cpu", action="store_true", help="the SmolLM2 GGUF on the CPU")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--deadline-s", type=float, default=None)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = parser.parse_args()
    # The CPU defaults are 32 prompts, as the comparison with llama.cpp asks.
    defaults = dict(new_tokens=(32, 128), num_prompts=(32, 256), prompt_len=(64, 512),
                    output_len=(64, 512))
    for name, (cpu, gpu) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, cpu if args.cpu else gpu)
    env = environment()
    if args.cpu:
        run_cpu(args, env)
    else:
        run_shapes("quant", args.shapes, lambda name, tmp: run_gpu_shape(name, args, env, tmp),
                   args.deadline_s)


if __name__ == "__main__":
    main()
