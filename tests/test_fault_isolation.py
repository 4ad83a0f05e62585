"""A failure in one request's work ends that request alone, with finish reason "error".

Faults are injected into one request of a batch of 16 (an exception in its sampling, NaN logits
in its row, an exception in its detokenization), with overlapped steps and step by step: the
other 15 must produce exactly their solo greedy tokens, and every block must come back.
"""
from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams

PROMPTS = [f"Request {i} says" + " hello" * (i % 5) for i in range(16)]
TARGET = 5  # the request at fault
FAULT_FROM = 3  # its fault strikes from its third sampled token on, every time after
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    engine = LLM(str(tiny_llama), device="cpu", dtype="float32", max_num_seqs=16,
                 num_kv_blocks=128)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def solo(llm):
    return [llm.generate([p], PARAMS, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


def _inject(llm, kind: str, monkeypatch) -> None:
    """Make request TARGET's work fail, ``kind`` telling how, from its FAULT_FROM-th token."""
    engine, runner = llm.engine, llm.engine.executor
    target = {}  # the id of the request at fault, found by its prompt, and its row
    strikes = []

    def row_of(step) -> int | None:
        rows = [c for c in step.chunks if c.sample]
        for i, chunk in enumerate(rows):
            if chunk.prompt_token_ids == target.get("prompt"):
                strikes.append(1)
                return i if len(strikes) >= FAULT_FROM else None
        return None

    target["prompt"] = llm.tokenizer.encode(PROMPTS[TARGET])
    if kind == "detokenize":
        append = engine.output_processor.append_token

        def failing_append(req, token, now):
            if req.prompt_token_ids == target["prompt"] and req.num_output_tokens >= FAULT_FROM:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            return append(req, token, now)

        monkeypatch.setattr(engine.output_processor, "append_token", failing_append)
        return
    rank0 = getattr(runner, "runner", runner)  # a tensor-parallel executor's own runner
    launch, sampler, logits_of = runner.launch, rank0.sampler, rank0.model.compute_logits
    current: dict[str, int | None] = {"row": None}

    def traced_launch(step):
        current["row"] = row_of(step)
        return launch(step)

    def failing_sampler(logits, tensors):
        if current["row"] is not None:
            raise RuntimeError("injected sampling failure")
        return sampler(logits, tensors)

    def nan_logits(hidden):
        logits = logits_of(hidden)
        if current["row"] is not None:
            logits[current["row"]] = torch.nan
        return logits

    monkeypatch.setattr(runner, "launch", traced_launch)
    if kind == "raise":
        monkeypatch.setattr(rank0, "sampler", failing_sampler)
    else:
        monkeypatch.setattr(rank0.model, "compute_logits", nan_logits)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("kind", ["raise", "nan", "detokenize"])
def test_one_failing_request_of_sixteen(llm, solo, kind, overlap, monkeypatch):
    if not overlap:
        monkeypatch.setattr(llm.engine.executor, "feeds_pending_tokens", False)
    _assert_only_the_target_fails(llm, solo, kind, monkeypatch)


@pytest.mark.parametrize("kind", ["raise", "nan", "detokenize"])
def test_one_failing_request_under_tensor_parallelism(tiny_llama, solo, kind, monkeypatch):
    """Rank 0's sampling fails after the step's collectives: the workers are in step, so
    the group runs on and only the request at fault ends."""
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", max_num_seqs=16,
              num_kv_blocks=128, tensor_parallel_size=2)
    try:
        _assert_only_the_target_fails(llm, solo, kind, monkeypatch)
        assert not llm.engine.executor.stopped
        again = llm.generate(PROMPTS[:2], PARAMS, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == solo[:2]
    finally:
        llm.close()


def _assert_only_the_target_fails(llm, solo, kind, monkeypatch) -> None:
    engine = llm.engine
    free = engine.block_manager.num_free_blocks
    _inject(llm, kind, monkeypatch)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    for i, out in enumerate(outs):
        if i != TARGET:
            assert (out.token_ids, out.finish_reason) == (solo[i], "length"), i
    failed = outs[TARGET]
    assert failed.finish_reason == "error"
    cause = {"raise": "injected sampling", "nan": "not finite", "detokenize": "injected"}[kind]
    assert cause in failed.stop_reason
    # What it produced before its fault is what it would have produced.
    assert failed.token_ids == solo[TARGET][:len(failed.token_ids)]
    assert len(failed.token_ids) < len(solo[TARGET])
    assert engine.block_manager.num_free_blocks == free
    assert not engine.requests and not engine.has_unfinished_requests()
    assert not engine.fault_hunt.groups

