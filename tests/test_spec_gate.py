"""The speculation gate: it runs the way whose measured output rate is higher, per batch-size
bucket, tries the other way now and then, and keeps greedy outputs exact while it switches."""
from __future__ import annotations

import numpy as np
import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.engine import spec_gate
from nanoserve.engine.spec_gate import SpecGate


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(gate: SpecGate, clock: Clock, steps: int, seconds: dict[bool, float],
        tokens: dict[bool, int], num_seqs: int = 4, prompt_every: int = 0) -> list[bool]:
    """``steps`` steps, each taking ``seconds[way]`` and yielding ``tokens[way]``."""
    ways = []
    for i in range(steps):
        way = gate.begin(num_seqs)
        ways.append(way)
        clock.now += seconds[way]
        gate.end(tokens[way], computed_prompt=bool(prompt_every) and i % prompt_every == 0)
    gate.begin(num_seqs)  # closes the last step's time
    return ways


def test_speculation_that_pays_keeps_running_and_is_tried_against_rarely():
    clock = Clock()
    gate = SpecGate(clock)
    # Speculating: 3 tokens a sequence in 2 ms; plain: 1 in 1 ms.
    ways = run(gate, clock, 400, {True: 2e-3, False: 1e-3}, {True: 12, False: 4})
    assert ways[:spec_gate.FIRST_TRIAL_AFTER + 1] == [True] * (spec_gate.FIRST_TRIAL_AFTER + 1)
    trials = sum(1 for a, b in zip(ways, ways[1:]) if a and not b)
    assert 2 <= trials <= 6  # each trial that confirms doubles the wait for the next
    assert ways.count(False) == trials * spec_gate.TRIAL_STEPS[False]
    bucket = gate.buckets[4]
    assert bucket.preferred and bucket.interval > 4 * spec_gate.FIRST_TRIAL_AFTER


def test_speculation_that_loses_is_switched_off_and_retried():
    clock = Clock()
    gate = SpecGate(clock)
    # Speculating: 1.5 tokens a sequence in 3 ms; plain: 1 in 1 ms.
    ways = run(gate, clock, 400, {True: 3e-3, False: 1e-3}, {True: 6, False: 4})
    first_trial_end = spec_gate.FIRST_TRIAL_AFTER + 1 + spec_gate.TRIAL_STEPS[False]
    assert not any(ways[first_trial_end:first_trial_end + spec_gate.AFTER_A_CHANGE])
    assert ways.count(True) < 40  # the trials of speculation, ever rarer
    assert not gate.buckets[4].preferred
    assert gate.num_plain_steps == ways.count(False) + 1  # with run()'s closing begin


def test_a_rate_is_tokens_over_seconds_of_recent_steps():
    """Verify steps that yield 1, 1, 1 then 9 tokens a sequence (3 on average, in 2 ms) beat
    plain steps of 1 token in 1 ms, whichever steps a trial follows."""
    clock = Clock()
    gate = SpecGate(clock)
    pattern = [4, 4, 4, 36]
    ways = []
    for i in range(600):
        way = gate.begin(4)
        ways.append(way)
        clock.now += 2e-3 if way else 1e-3
        gate.end(pattern[i % 4] if way else 4, computed_prompt=False)
    assert gate.buckets[4].preferred and ways.count(True) > 540


def test_buckets_are_judged_apart_and_prompt_steps_are_not_measured():
    clock = Clock()
    gate = SpecGate(clock)
    run(gate, clock, 200, {True: 3e-3, False: 1e-3}, {True: 6, False: 4}, num_seqs=64)
    assert gate.begin(10) is False  # a new bucket starts as its nearest runs
    run(gate, clock, 200, {True: 2e-3, False: 1e-3}, {True: 12, False: 4}, num_seqs=2)
    # The batch-2 bucket starts as the batch-64 one runs, then finds speculation faster.
    assert not gate.buckets[64].preferred and gate.buckets[4].preferred
    # Prompt steps yield few tokens over a long time: were they measured, plain would lose.
    clock2 = Clock()
    gate2 = SpecGate(clock2)
    ways = run(gate2, clock2, 300, {True: 2e-3, False: 1e-3}, {True: 12, False: 4},
               prompt_every=2)
    assert gate2.buckets[4].preferred and ways.count(True) > 250
    assert [SpecGate.bucket_of(n) for n in (1, 2, 4, 5, 16, 17, 256)] == [1, 4, 4, 16, 16, 64, 256]


def test_idle_time_is_no_steps_time():
    clock = Clock()
    gate = SpecGate(clock)
    run(gate, clock, 20, {True: 2e-3, False: 1e-3}, {True: 12, False: 4})
    rate = gate.buckets[4].rate[True].value
    gate.idle()
    clock.now += 60.0  # no request for a minute
    gate.begin(4)
    assert gate.buckets[4].rate[True].value == rate


@pytest.fixture(scope="module")
def repeating_ids() -> list[list[int]]:
    """Token-id prompts that repeat themselves, so that proposals come."""
    gen = np.random.default_rng(2)
    return [gen.integers(100, 5000, size=n).tolist() * 4 for n in (5, 8, 11)] + [[9] * 30]


@pytest.mark.parametrize("slow", [True, False])
def test_engine_switches_ways_and_greedy_stays_exact(tiny_llama, repeating_ids, slow):
    """With a clock that makes verify steps slow (or fast), the engine turns speculation off
    (or keeps it) and its greedy tokens equal those of an engine without speculation."""
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
              "prompt_lookup_max": 3}
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", speculative_config=config)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = LLM(str(tiny_llama), device="cpu", dtype="float32")
    want = [o.outputs[0].token_ids for o in plain.generate(repeating_ids, params,
                                                             use_tqdm=False)]
    gate = llm.engine.spec.gate
    clock = Clock()

    def tick() -> float:  # a step's time: verify steps 10x (or 0.1x) a plain step's
        step = gate._step
        clock.now += (10.0 if slow else 0.1) if step is not None and step.speculating else 1.0
        return clock.now

    gate.clock = tick
    outs = llm.generate(repeating_ids, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    stats = llm.engine.stats().spec
    assert stats.num_draft_tokens > 0
    bucket = gate.buckets[SpecGate.bucket_of(len(repeating_ids))]
    assert bucket.preferred is not slow
    assert (gate.num_plain_steps > 8) is slow
