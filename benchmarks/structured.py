"""Structured output's cost: throughput and batch-1 decode with every request held to a JSON
schema, against the same requests unconstrained, and grammar compile times.

Throughput is throughput.py's workload (nano-vLLM's: 256 requests, random prompts and lengths,
temperature 0.6); the constrained run holds each answer to a list of at least 1,000 records,
which no answer completes, so both runs generate the same tokens. Batch-1: one request, a
128-token prompt, 256 new tokens. Compile times: the test schemas (tests/json_schemas.py),
each compiled afresh. One JSON line per shape; ``--device cpu --shapes smollm2`` runs the real
SmolLM2 on the CPU with a smaller workload.

    python benchmarks/structured.py --shapes qwen3-0.6b qwen3-8b
    python benchmarks/structured.py --device cpu --shapes smollm2 --num-seqs 32 \\
        --max-input-len 128 --max-output-len 128
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from nanoserve.bench.common import (add_deadline_argument, emit, environment, free_device_memory, run_shapes,
                    sync)
from nanoserve.bench.shapes import SHAPES, make_model_dir
from nanoserve.bench.throughput import host_profile, workload

from nanoserve import LLM, SamplingParams, StructuredOutputsParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from json_schemas import SCHEMAS  # noqa: E402

RECORDS = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "score", "tags"],
    "properties": {"id": {"type": "integer", "minimum": 0},
                   "name": {"type": "string", "maxLength": 24},
                   "score": {"type": "number", "minimum": 0, "maximum": 100},
                   "tags": {"type": "array", "maxItems": 4,
                            "items": {"enum": ["new", "hot", "sale", "rare"]}}}}}


def timed(llm: LLM, prompts: list[list[int]], params: list[SamplingParams],
          device: str, profile: bool = False) -> tuple[float, int]:
    """Seconds and output tokens of one pass, with no prefix cached from an earlier one."""
    assert llm.reset_prefix_cache(), "every request of the last run has finished"
    sync(device)
    with host_profile(profile):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync(device)
        elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def compile_ms(llm: LLM) -> list[float]:
    from nanoserve.engine.structured_output import GrammarCompiler

    engine = llm.engine
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size,
                               list(engine.model_config.eos_token_ids))
    times = []
    for schema in SCHEMAS:
        start = time.perf_counter()
        compiler.compile(StructuredOutputsParams(json=schema))
        times.append((time.perf_counter() - start) * 1e3)
    compiler.close()
    return sorted(times)


def run_shape(name: str, args: argparse.Namespace, env: dict, tmp: Path) -> None:
    extra = {} if args.device == "auto" else {"device": args.device}
    if name == "smollm2":
        llm = LLM(None, max_num_seqs=max(args.num_seqs, 1), **extra)
    else:
        llm = LLM(str(make_model_dir(name, tmp / name)), load_format="dummy",
                  max_num_seqs=max(args.num_seqs, 1), **extra)
    try:
        constraint = StructuredOutputsParams(json=RECORDS)
        prompts, max_tokens = workload(args.num_seqs, args.max_input_len, args.max_output_len,
                                       args.seed)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, structured_outputs=constraint),
                     use_tqdm=False)  # warm-up, and the grammar compiled once
        record = {"bench": "structured", "shape": name, "num_seqs": args.num_seqs}
        for label, so in (("free", None), ("json", constraint)):
            params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n,
                                     structured_outputs=so) for n in max_tokens]
            seconds, tokens = timed(llm, prompts, params, args.device,
                                    args.host_profile and so is not None)
            assert tokens == sum(max_tokens), "every request must run to max_tokens"
            record[f"{label}_tok_s"] = round(tokens / seconds, 1)
            one = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.batch1_tokens,
                                  structured_outputs=so)]
            timed(llm, [list(range(1, 129))], [SamplingParams(max_tokens=1)], args.device)
            seconds, tokens = timed(llm, [list(range(1, 129))], one, args.device,
                                    args.host_profile and so is not None)
            record[f"{label}_batch1_ms"] = round(seconds / tokens * 1e3, 3)
        record["throughput_ratio"] = round(record["json_tok_s"] / record["free_tok_s"], 3)
        record["batch1_ratio"] = round(record["json_batch1_ms"] / record["free_batch1_ms"], 3)
        times = compile_ms(llm)
        record.update(compile_ms_p50=round(statistics.median(times), 2),
                      compile_ms_p99=round(times[min(len(times) - 1,
                                                     int(0.99 * len(times)))], 2),
                      compiled_schemas=len(times))
        emit({**record, **env})
    finally:
        llm.close()
        free_device_memory()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3-0.6b"],
                        choices=sorted(SHAPES) + ["smollm2"], metavar="SHAPE")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--batch1-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    add_deadline_argument(parser)
    parser.add_argument("--host-profile", action="store_true",
                        help="print (to stderr) a cProfile of the host over the constrained runs")
    args = parser.parse_args()
    env = environment()
    run_shapes("structured", args.shapes, lambda shape, tmp: run_shape(shape, args, env, tmp),
               args.deadline_s)


if __name__ == "__main__":
    main()
