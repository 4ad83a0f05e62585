"""The `nanoserve` command: generate, chat and serve, sharing one set of engine flags; tune."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys

from nanoserve.config import EngineConfig
from nanoserve.sampling_params import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every `LLM(...)` argument as a flag, generated from EngineConfig so they never drift."""
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "model":
            group.add_argument("--model", default=None,
                               help="local HF folder or .gguf file (default: SmolLM2-135M)")
        elif f.type in ("bool",):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif f.type in ("int", "int | None"):
            group.add_argument(flag, type=int, default=f.default)
        elif f.type == "float":
            group.add_argument(flag, type=float, default=f.default)
        else:
            group.add_argument(flag, type=str, default=f.default)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--temperature", type=float, default=0.7)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--sampling-seed", type=int, default=None,
                       help="per-request sampling seed (--seed seeds the engine)")
    group.add_argument("--max-tokens", type=int, default=128)
    group.add_argument("--stop", action="append", default=None)
    group.add_argument("--ignore-eos", action="store_true")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.sampling_seed,
        max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos)


def cmd_generate(args: argparse.Namespace) -> int:
    from nanoserve.llm import LLM

    llm = LLM(**dataclasses.asdict(engine_config_from_args(args)))
    prompts = args.prompt or ["Hello, my name is"]
    params = sampling_params_from_args(args)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params) \
        if args.chat_template else llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        print(f"### {prompt}\n{out.outputs[0].text}\n", flush=True)
    llm.close()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from nanoserve.llm import LLM

    llm = LLM(**dataclasses.asdict(engine_config_from_args(args)))
    params = sampling_params_from_args(args)
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
    from nanoserve.kernels.tune import tune_model

    tune_model(args.model, tuple(args.rows), args.tensor_parallel_size)
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

    tune = sub.add_parser("tune", help="time the decode GEMV's tiles for a model's projections "
                                       "on this GPU and write them to its tuning file")
    tune.add_argument("model", help="local HF folder or .gguf file (only its config is read)")
    tune.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8],
                      choices=[1, 2, 4, 8], help="decode batch sizes to tune")
    tune.add_argument("--tensor-parallel-size", type=int, default=1,
                      help="tune the projections one rank holds at this TP size")
    tune.set_defaults(func=cmd_tune)

    from nanoserve.entrypoints.server import add_serve_parser
    add_serve_parser(sub)
    return parser


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
