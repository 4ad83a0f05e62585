"""Speculative decoding: ms per output token and acceptance with and without it, batch 1 and a batch.

Acceptance depends on the weights, so it is controlled in one of two ways:

* ``--model PATH`` (default: the packaged SmolLM2-135M, real weights): n-gram proposals on
  prompts that ask to repeat a passage they contain, whose greedy continuation copies it.
* ``--shapes`` (random weights of real shapes) with ``--synthetic-acceptance P``: the
  proposer is told the answer. The weights are made to copy (o_proj and down_proj zeroed, the
  LM head the embedding: the greedy answer repeats the last token, by a margin no rounding
  flips, at the same cost per step). A first run without speculation records each prompt's
  greedy continuation; then each proposal is that continuation's next token with probability
  P, and otherwise a token that the verify rejects; a step proposes ``k`` tokens whenever
  max_tokens leaves room. This measures the verify step's cost at a known acceptance (one
  proposal is accepted with probability P, the first ``i`` with P^i).

For each configuration, one JSON line without speculation and with it (``--shapes``: with
every step speculating, ``gate: false``, and as the engine runs it, ``gate: true``):
``ms_per_token`` is (t(N tokens) - t(1 token)) / (N - 1) per sequence (the prefill drops
out), ``tokens_per_s`` the batch's output rate over the same steps, ``acceptance`` accepted /
proposed tokens.

    python benchmarks/spec_decode.py --shapes qwen3-0.6b qwen3-8b --synthetic-acceptance 0.5 0.8 0.9
    python benchmarks/spec_decode.py --device cpu --batch-sizes 1 4 --new-tokens 32   # SmolLM2
    python benchmarks/spec_decode.py --model TARGET --draft-model DRAFT --k 3
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from nanoserve.bench.common import (add_deadline_argument, emit, environment, free_device_memory,
                                    run_shapes, sync)
from nanoserve.bench.shapes import SHAPES, config_of, make_model_dir

from nanoserve import LLM, SamplingParams
from nanoserve.engine.spec_gate import SpecGate

PASSAGE = ("The committee met on Tuesday to review the budget. After a long debate about the "
           "cost of the new library, the members agreed to delay the vote until the spring, "
           "when the final figures from the city would be known. The chair thanked everyone.")


def repeat_prompts(batch: int) -> list[str]:
    """Prompts whose greedy continuation copies a passage they hold."""
    return [f"Copy the text exactly, {i + 1}.\nText: {PASSAGE}\nCopy: {PASSAGE}\nCopy:"
            for i in range(batch)]


class ToldProposer:
    """Proposes each prompt's recorded greedy continuation, each token right with
    probability ``p`` (a wrong one otherwise), as many tokens as the engine's adaptive
    proposal length asks."""

    def __init__(self, llm: LLM, answers: dict[tuple[int, ...], list[int]], k: int, p: float,
                 vocab: int, seed: int = 0):
        self.spec = llm.engine.spec
        self.answers, self.k, self.p, self.vocab = answers, k, p, vocab
        self.rng = random.Random(seed)

    def __call__(self, req) -> list[int]:
        if not self.spec.active:  # the gate runs this step without proposals
            return []
        room = self.spec._budget(req)  # the engine's own length: adaptive, paused after misses
        done = req.num_output_tokens
        truth = self.answers[tuple(req.prompt_token_ids)][done:done + room]
        return [t if self.rng.random() < self.p else (t + 1) % self.vocab for t in truth]


@torch.inference_mode()
def make_copying(llm: LLM) -> None:
    """Turn random weights into a model whose greedy answer repeats its last token: every
    layer adds nothing to the residual stream, and the LM head scores the embedding."""
    model = llm.engine.executor.model
    for name, param in model.named_parameters():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            param.zero_()
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)


def time_generate(llm: LLM, prompts: list, new_tokens: int, repeats: int, device: str
                  ) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure(llm: LLM, prompts: list, args: argparse.Namespace, spec_on: bool,
            gate: bool = True) -> dict:
    """``gate=False``: every step speculates (the gate that runs steps without proposals
    where they are faster is off)."""
    engine = llm.engine
    saved = engine.spec, engine.scheduler.proposer
    saved_gate = engine.spec.gate if engine.spec is not None else None
    if not spec_on:
        engine.spec = engine.scheduler.proposer = None
    else:  # a fresh gate: what it learned before was at another acceptance
        engine.spec.gate = SpecGate() if gate else None
    try:
        before = engine.stats().spec
        full = time_generate(llm, prompts, args.new_tokens, args.repeats, args.device)
        after = engine.stats().spec
        first = time_generate(llm, prompts, 1, args.repeats, args.device)
    finally:
        engine.spec, engine.scheduler.proposer = saved
        if engine.spec is not None:
            engine.spec.gate = saved_gate
    steps = args.new_tokens - 1
    record = {"speculation": spec_on, "batch": len(prompts), "new_tokens": args.new_tokens,
              "ms_per_token": round((full - first) / steps * 1e3, 4),
              "tokens_per_s": round(len(prompts) * steps / (full - first), 1)}
    if spec_on:
        record["gate"] = gate
        drafted = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        record["acceptance"] = round(accepted / drafted, 4) if drafted else None
        record["accepted_per_pos"] = [a - b for a, b in zip(after.accepted_per_pos,
                                                            before.accepted_per_pos)]
    return record


def engine_args(args: argparse.Namespace, k: int, draft: str | None = None) -> dict:
    extra = {} if args.device == "auto" else {"device": args.device}
    spec = ({"method": "draft_model", "model": draft, "num_speculative_tokens": k} if draft
            else {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                  "prompt_lookup_max": 4})
    return dict(max_model_len=args.max_model_len, max_num_seqs=max(args.batch_sizes),
                enable_prefix_caching=False, enforce_eager=args.enforce_eager,
                speculative_config=spec, **extra)


def run_model(args: argparse.Namespace, env: dict) -> None:
    for k in args.k:
        llm = LLM(args.model, **engine_args(args, k, args.draft_model))
        try:
            for batch in args.batch_sizes:
                prompts = repeat_prompts(batch)
                time_generate(llm, prompts, 8, 1, args.device)  # warm-up
                for spec_on in (False, True):
                    emit({"bench": "spec_decode", "model": args.model or "SmolLM2-135M",
                          "proposer": args.draft_model or "ngram", "k": k, **measure(llm, prompts, args, spec_on),
                          **env})
        finally:
            llm.close()
            free_device_memory()


def run_shape(name: str, args: argparse.Namespace, env: dict, tmp: Path) -> None:
    shape = config_of(name, args.layers)
    model_dir = make_model_dir(name, tmp / name, num_hidden_layers=args.layers)
    vocab = min(shape["vocab_size"], 10000)
    for k in args.k:
        llm = LLM(str(model_dir), load_format="dummy", **engine_args(args, k))
        make_copying(llm)
        try:
            for batch in args.batch_sizes:
                rng = random.Random(batch)
                prompts = [[rng.randrange(vocab) for _ in range(args.context)]
                           for _ in range(batch)]
                time_generate(llm, prompts, 8, 1, args.device)  # warm-up
                base = measure(llm, prompts, args, spec_on=False)
                emit({"bench": "spec_decode", "shape": name, "k": k, **base, **env})
                with_spec = llm.engine.spec, llm.engine.scheduler.proposer
                llm.engine.spec = llm.engine.scheduler.proposer = None
                outs = llm.generate(prompts, SamplingParams(
                    temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True), use_tqdm=False)
                llm.engine.spec, llm.engine.scheduler.proposer = with_spec
                answers = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in outs}
                for p in args.synthetic_acceptance:
                    llm.engine.scheduler.proposer = ToldProposer(llm, answers, k, p,
                                                                 shape["vocab_size"])
                    for gate in (False, True):
                        emit({"bench": "spec_decode", "shape": name, "k": k,
                              "proposer": "told", "synthetic_acceptance": p,
                              **measure(llm, prompts, args, True, gate), **env})
                llm.engine.scheduler.proposer = with_spec[1]
        finally:
            llm.close()
            free_device_memory()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None,
                        help="a real model for n-gram proposals (default: SmolLM2-135M)")
    parser.add_argument("--draft-model", default=None,
                        help="with --model: a draft model's path instead of n-gram lookup")
    parser.add_argument("--shapes", nargs="+", default=None, choices=sorted(SHAPES),
                        metavar="SHAPE", help="random-weight shapes (with --synthetic-acceptance)")
    parser.add_argument("--synthetic-acceptance", nargs="+", type=float, default=[0.5, 0.8, 0.9])
    parser.add_argument("--k", nargs="+", type=int, default=[4], help="num_speculative_tokens")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--context", type=int, default=128, help="prompt length with --shapes")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--enforce-eager", action="store_true")
    add_deadline_argument(parser)
    args = parser.parse_args()
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2")
    env = environment()
    if args.shapes:
        run_shapes("spec_decode", args.shapes, lambda s, tmp: run_shape(s, args, env, tmp),
                   args.deadline_s)
    else:
        run_model(args, env)


if __name__ == "__main__":
    main()
