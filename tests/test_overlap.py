"""Overlapped steps: the engine launches step N+1 before it collects step N's tokens.

The overlapped engine must produce exactly what the step-by-step one does, through stops,
aborts and penalties, and hand back every block.
"""
from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "Q: What is 2+2?\nA:"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    engine = LLM(str(tiny_llama), device="cpu", dtype="float32", max_num_seqs=4)
    yield engine
    engine.close()


@pytest.fixture
def trace(llm, monkeypatch):
    """The executor's launches ("L") and result collections ("R"), in order."""
    events: list[str] = []
    executor = llm.engine.executor
    launch = executor.launch

    def traced_launch(step):
        events.append("L")
        pending = launch(step)
        result = pending.result
        pending.result = lambda: (events.append("R"), result())[1]
        return pending

    monkeypatch.setattr(executor, "launch", traced_launch)
    return events


def _run(llm, params):
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason)
            for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _sync(llm, monkeypatch):
    monkeypatch.setattr(llm.engine.executor, "feeds_pending_tokens", False)


def test_next_step_is_launched_before_the_last_is_collected(llm, trace):
    _run(llm, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    # Prefill launched; each later launch comes before the previous step's collection.
    assert "".join(trace) == "L" + "LR" * 5 + "R"


def test_penalties_turn_the_overlap_off(llm, trace):
    _run(llm, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                             repetition_penalty=1.3))
    assert "".join(trace) == "LR" * 6


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=3, max_tokens=12, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=12, frequency_penalty=0.5),
])
def test_overlapped_tokens_equal_step_by_step(llm, params, monkeypatch):
    overlapped = _run(llm, params)
    _sync(llm, monkeypatch)
    assert _run(llm, params) == overlapped


def test_stop_token_ends_exactly_where_step_by_step_does(llm, monkeypatch):
    free = llm.engine.block_manager.num_free_blocks
    base = _run(llm, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    stop = base[0][0][4]  # the fifth token of the first continuation
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                            stop_token_ids=[stop])
    overlapped = _run(llm, params)
    assert overlapped[0] == (base[0][0][:5], "stop")
    _sync(llm, monkeypatch)
    assert _run(llm, params) == overlapped
    # The token sampled after the stop, while the stop was still on the device, is dropped
    # and its blocks come back.
    assert llm.engine.block_manager.num_free_blocks == free
    assert not llm.engine.has_unfinished_requests()


def test_abort_while_a_step_is_in_flight(llm):
    engine = llm.engine
    free = engine.block_manager.num_free_blocks
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    engine.add_request("x", PROMPTS[0], params)
    engine.add_request("y", PROMPTS[1], params)
    for _ in range(3):
        engine.step()
    assert engine.in_flight is not None
    engine.abort_request("x")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
    assert finished["x"].finish_reason == "abort" and len(finished["x"].token_ids) == 2
    assert finished["y"].finish_reason == "length" and len(finished["y"].token_ids) == 50
    assert engine.block_manager.num_free_blocks == free


@pytest.mark.parametrize("failing_call", [1, 3])
def test_a_failed_step_loses_no_token(llm, failing_call, monkeypatch):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = [tokens for tokens, _ in _run(llm, params)]
    engine, runner = llm.engine, llm.engine.executor
    free = engine.block_manager.num_free_blocks
    sample, calls = runner.sampler, []

    def failing_once(logits, tensors):
        calls.append(1)
        if len(calls) == failing_call:
            raise RuntimeError("injected sampler failure")
        return sample(logits, tensors)

    monkeypatch.setattr(runner, "sampler", failing_once)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"f{i}", prompt, params)
    got = {}
    # No request is at fault (each runs fine apart): the engine isolates them, then carries on.
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
    assert len(calls) > failing_call and [got[f"f{i}"] for i in range(len(PROMPTS))] == want
    assert engine.block_manager.num_free_blocks == free
