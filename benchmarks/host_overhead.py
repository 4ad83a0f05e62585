"""Host (Python) time per decode step, with no model: the part of a step the GPU waits on.

Engine bookkeeping is timed with a stub executor that returns random ids at once; the
runner's input preparation and the sampler's tensors are timed on a tiny random model on the
CPU, and so is what a decode-graph step does on the host instead of both: its rows, the
temperature check and the packing of its one upload (``runner/graph_inputs.py``; the arena is
in CPU memory here). Shape: --num-seqs running requests of --prompt-len prompt tokens,
decoding. Prints one JSON line (milliseconds per step).
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from common import make_model_dir

from nanoserve.config import EngineConfig, ModelConfig
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.gc_tuning import freeze_startup_heap
from nanoserve.runner.cuda_graph import capture_sizes
from nanoserve.runner.graph_inputs import GraphArena, decode_rows
from nanoserve.runner.inputs import CompletedStep, SequenceChunk, StepOutput
from nanoserve.runner.sampling_tensors import SamplingTensors, draw_noise_seed, temperatures_only
from nanoserve.sampling_params import SamplingParams

QWEN3_06B = ModelConfig("Qwen3ForCausalLM", 1024, 3072, 28, 16, 8, 128, 151936, 1e-6, 1e6, None,
                        40960, True, False, True, "bfloat16", [151645])


class StubExecutor:
    """Answers every step at once with random ids: what is left is the engine's own time."""

    num_kv_blocks = 40000
    stopped = False
    feeds_pending_tokens = True

    def launch(self, step) -> CompletedStep:
        return CompletedStep(StepOutput([random.randint(100, 30000)
                                         for c in step.chunks if c.sample]))

    def close(self) -> None:
        pass


def engine_ms(num_seqs: int, prompt_len: int, steps: int, freeze: bool) -> float:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(".cache/qwen3-tokenizer")
    engine = LLMEngine(EngineConfig(max_num_seqs=num_seqs), QWEN3_06B, tokenizer,
                       StubExecutor(), "stub")
    if freeze:
        freeze_startup_heap()  # as LLMEngine.from_config does
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=steps + 10)
    for i in range(num_seqs):
        engine.add_request(str(i), [random.randint(0, 10000) for _ in range(prompt_len)],
                           params, stream=False)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps * 1e3


def runner_ms(num_seqs: int, prompt_len: int, steps: int) -> tuple[float, float, float]:
    from nanoserve import LLM

    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(make_model_dir("tiny-qwen3", Path(tmp) / "m")), load_format="dummy",
                  device="cpu", num_kv_blocks=num_seqs * (prompt_len // 16 + 2))
    runner = llm.engine.executor
    params = SamplingParams(temperature=0.6, ignore_eos=True)
    blocks = prompt_len // 16 + 1
    chunks = [SequenceChunk(str(i), [5], prompt_len, list(range(i * blocks, (i + 1) * blocks)),
                            True, params, [1] * prompt_len, [], []) for i in range(num_seqs)]

    def build() -> SamplingTensors:
        return SamplingTensors.build([c.params for c in chunks],
                                     [c.prompt_token_ids for c in chunks],
                                     [c.output_token_ids for c in chunks],
                                     [c.banned_token_ids for c in chunks], [None] * num_seqs,
                                     QWEN3_06B.vocab_size, runner.device)

    sizes = capture_sizes(num_seqs)
    arena = GraphArena(sizes, blocks + 1, num_seqs, runner.device)

    def stage() -> None:
        temperature = temperatures_only([c.params for c in chunks],
                                        [c.banned_token_ids for c in chunks], [None] * num_seqs,
                                        QWEN3_06B.vocab_size)
        arena.stage(sizes[-1], decode_rows(chunks, 16, {}), temperature,
                    draw_noise_seed(bool(temperature.any())))

    timings = []
    for fn in (lambda: runner._prepare(chunks), build, stage):
        fn()
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        timings.append((time.perf_counter() - start) / steps * 1e3)
    return timings[0], timings[1], timings[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=500)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--no-gc-freeze", action="store_true",
                        help="leave the start-up heap to the garbage collector (the old way)")
    args = parser.parse_args()
    random.seed(0)
    # The engine first: building the runner's LLM freezes the heap itself.
    engine = engine_ms(args.num_seqs, args.prompt_len, args.steps, not args.no_gc_freeze)
    prepare, sampling, graph_inputs = runner_ms(args.num_seqs, args.prompt_len, args.steps)
    print(json.dumps({"bench": "host_overhead", "num_seqs": args.num_seqs,
                      "engine_ms_per_step": round(engine, 3),
                      "gc_freeze": not args.no_gc_freeze,
                      "prepare_inputs_ms": round(prepare, 3),
                      "sampling_tensors_ms": round(sampling, 3),
                      "graph_step_inputs_ms": round(graph_inputs, 3),
                      "date": time.strftime("%Y-%m-%d")}))


if __name__ == "__main__":
    main()
