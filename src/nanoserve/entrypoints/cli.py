"""The `nanoserve` command: generate, chat and serve, sharing one set of engine flags; tune."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys

from nanoserve.config import EngineConfig
from nanoserve.sampling_params import SamplingParams


# Help for each EngineConfig field (vLLM's meanings); a field without one fails test_cli.
ENGINE_HELP = {
    "model": "local Hugging Face folder or .gguf file (default: the packaged SmolLM2-135M)",
    "dtype": "weights' and activations' dtype: auto (the checkpoint's; bfloat16 for fp32 "
             "checkpoints on a GPU), float32, float16, bfloat16",
    "device": "auto (CUDA if present), cpu, cuda or cuda:N",
    "max_model_len": "longest prompt + answer, in tokens (default: the model's positions)",
    "max_num_seqs": "most sequences in one batch",
    "max_num_batched_tokens": "most tokens one step computes (prefill chunks + decodes)",
    "block_size": "tokens per KV-cache block (a power of two)",
    "num_kv_blocks": "KV-cache blocks to allocate (default: sized from the memory budget)",
    "kv_cache_memory": "bytes for the KV cache (default: 1 GiB on the CPU; on a GPU what "
                       "--gpu-memory-utilization leaves)",
    "kv_cache_dtype": "auto (the model's dtype) or fp8 (= fp8_e4m3, one byte per value)",
    "gpu_memory_utilization": "fraction of the GPU's memory the engine may use",
    "enable_prefix_caching": "reuse the KV blocks of prompts' shared prefixes",
    "disable_hybrid_kv_cache_manager": "one block table for sliding-window and full layers "
                                       "alike (sliding layers then keep their whole sequence)",
    "tensor_parallel_size": "split every layer across this many ranks (GPUs or CPU processes)",
    "enforce_eager": "never capture CUDA graphs",
    "seed": "the engine's random seed",
    "load_format": "auto (read the checkpoint) or dummy (random weights of its shape)",
    "max_n": "most samples (n, best_of) one request may ask for",
    "max_logprobs": "most top logprobs per token one request may ask for",
    "max_waiting_requests": "refuse requests (503) while this many wait (default: no bound)",
    "max_waiting_tokens": "refuse requests (503) while the requests waiting hold this many "
                          "prompt tokens (default: no bound)",
    "quantization": "auto (a quantized checkpoint stays quantized: GGUF, AWQ, GPTQ, FP8), none "
                    "(dequantize at load) or fp8 (quantize a 16-bit checkpoint at load)",
    "speculative_config": "speculative decoding as JSON, vLLM's fields: {\"method\": \"ngram\" "
                          "or \"draft_model\", \"num_speculative_tokens\": k, ...}",
    "task": "generate, embed (pooled embeddings, /v1/embeddings) or auto (embed for a "
            "sentence-transformers folder)",
    "cpu_threads": "torch threads on the CPU, split between tensor-parallel ranks (default: "
                   "the cores free to this process at start-up: its affinity and cgroup "
                   "quota, less those other processes keep busy)",
    "pooling_type": "embeddings' pooling: last, mean or cls (default: the model's "
                    "1_Pooling config, else last)",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every `LLM(...)` argument as a flag, generated from EngineConfig so they never drift."""
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        text = ENGINE_HELP.get(f.name, "")
        if f.default is not None and "default:" not in text:
            text += " (default: %(default)s)"
        if f.name == "model":
            group.add_argument("--model", default=None, help=text)
        elif f.type in ("bool",):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                               help=text)
        elif f.type in ("int", "int | None"):
            group.add_argument(flag, type=int, default=f.default, help=text)
        elif f.type == "float":
            group.add_argument(flag, type=float, default=f.default, help=text)
        else:
            group.add_argument(flag, type=str, default=f.default, help=text)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--temperature", type=float, default=0.7,
                       help="0 = greedy (default: %(default)s)")
    group.add_argument("--top-p", type=float, default=1.0,
                       help="nucleus sampling's probability mass (default: %(default)s)")
    group.add_argument("--top-k", type=int, default=0,
                       help="sample from the k likeliest tokens; 0 = off (default: %(default)s)")
    group.add_argument("--min-p", type=float, default=0.0,
                       help="drop tokens under min_p x the top one's probability "
                            "(default: %(default)s)")
    group.add_argument("--repetition-penalty", type=float, default=1.0,
                       help="(default: %(default)s)")
    group.add_argument("--presence-penalty", type=float, default=0.0,
                       help="(default: %(default)s)")
    group.add_argument("--frequency-penalty", type=float, default=0.0,
                       help="(default: %(default)s)")
    group.add_argument("--sampling-seed", type=int, default=None,
                       help="per-request sampling seed (--seed seeds the engine)")
    group.add_argument("--max-tokens", type=int, default=128,
                       help="most tokens per answer (default: %(default)s)")
    group.add_argument("--stop", action="append", default=None,
                       help="a stop string (repeat for more)")
    group.add_argument("--ignore-eos", action="store_true", help="go on past end-of-sequence")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.sampling_seed,
        max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos)


def cmd_generate(args: argparse.Namespace) -> int:
    from nanoserve.llm import LLM

    params = sampling_params_from_args(args)  # bad flags fail before the model loads
    llm = LLM(**dataclasses.asdict(engine_config_from_args(args)))
    prompts = args.prompt or ["Hello, my name is"]
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params) \
        if args.chat_template else llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        print(f"### {prompt}\n{out.outputs[0].text}\n", flush=True)
    llm.close()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from nanoserve.llm import LLM

    params = sampling_params_from_args(args)  # bad flags fail before the model loads
    llm = LLM(**dataclasses.asdict(engine_config_from_args(args)))
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("nanoserve chat: type a message, Ctrl-D to quit", file=sys.stderr)
    try:
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                break
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            reply = ""
            # On Ctrl-C the reply is aborted here, before llm.close(), not when collected.
            with contextlib.closing(llm.stream_chat(history, params)) as deltas:
                for delta in deltas:
                    reply += delta
                    print(delta, end="", flush=True)
            print(flush=True)
            history.append({"role": "assistant", "content": reply})
    finally:
        llm.close()
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    if args.int4:
        from nanoserve.kernels.tune_int4 import tune_int4_model

        tune_int4_model(args.model, tuple(args.rows), args.tensor_parallel_size)
        return 0
    from nanoserve.kernels.tune import OPS, tune_model

    tune_model(args.model, tuple(args.rows), args.tensor_parallel_size, ops=args.ops or OPS,
               kv_cache_dtype=args.kv_cache_dtype)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts offline")
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    gen.add_argument("--chat-template", action="store_true",
                     help="wrap each prompt as a user message with the chat template")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat, streaming tokens as they come")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    tune = sub.add_parser("tune", help="time the kernels' launch configurations at a model's "
                                       "shapes on this GPU and write them to its tuning files")
    tune.add_argument("model", help="local HF folder or .gguf file (only its config is read)")
    tune.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8],
                      choices=[1, 2, 4, 8], help="the GEMV's decode batch sizes to tune")
    tune.add_argument("--tensor-parallel-size", type=int, default=1,
                      help="tune the projections one rank holds at this TP size")
    tune.add_argument("--ops", nargs="+", default=None,
                      help="the ops to tune (default: all; an unknown one lists them)")
    tune.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                      help="the cache decode attention is tuned over")
    tune.add_argument("--int4", action="store_true",
                      help="tune the int4 GEMV (AWQ / GPTQ / GGUF 4-bit weights) instead")
    tune.set_defaults(func=cmd_tune)

    bench = sub.add_parser("bench", help="benchmarks as vLLM's `vllm bench`: throughput "
                                         "(offline), latency (batch 1), serve (a running "
                                         "server); one JSON line each, --plot OUT.png",
                           add_help=False)
    bench.add_argument("benchmark", choices=BENCHMARKS)
    bench.add_argument("args", nargs=argparse.REMAINDER,
                       help="the benchmark's own flags (nanoserve bench NAME --help)")
    bench.set_defaults(func=cmd_bench)

    from nanoserve.entrypoints.serve_command import add_serve_parser
    add_serve_parser(sub)
    return parser


BENCHMARKS = ("throughput", "latency", "serve")


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(f"nanoserve.bench.{args.benchmark}")
    module.main(args.args, prog=f"nanoserve bench {args.benchmark}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"nanoserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C (in chat: while a reply streams): no traceback
        print(file=sys.stderr)
        return 130  # the shell's code for a process ended by SIGINT


if __name__ == "__main__":
    sys.exit(main())
