"""n samples per prompt in the offline API: each is the request seeded seed + index."""
from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), device="cpu", dtype="float32")


def test_n_samples_equal_the_requests_seeded_apart(llm):
    prompts = ["Hello there", [5, 6, 7, 8]]
    params = SamplingParams(n=3, seed=40, temperature=1.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) == 2
    for prompt, out in zip(prompts, outs):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        alone = [llm.generate([prompt], SamplingParams(seed=40 + k, temperature=1.0,
                                                       max_tokens=10, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0] for k in range(3)]
        assert [c.token_ids for c in out.outputs] == [a.token_ids for a in alone]
        assert [c.text for c in out.outputs] == [a.text for a in alone]
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "samples all alike"
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "blocks leaked"


def test_greedy_samples_are_identical_and_n_one_is_unchanged(llm):
    out = llm.generate("Hello", SamplingParams(n=2, temperature=0.0, max_tokens=6),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids
    one = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
    assert len(one.outputs) == 1 and one.outputs[0].token_ids == out.outputs[0].token_ids


def test_bad_n_is_refused_and_the_engine_takes_one_sequence(llm):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="n must"):
            SamplingParams(n=bad)
    with pytest.raises(ValueError, match="one sequence per request"):
        llm.engine.add_request("x", "Hello", SamplingParams(n=2))
