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


def test_bad_n_is_refused(llm):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="n must"):
            SamplingParams(n=bad)
    with pytest.raises(ValueError, match=r"n must be <= 128 \(the engine's max_n\)"):
        llm.engine.add_request("x", "Hello", SamplingParams(n=129))
    assert not llm.engine.requests


def test_samples_share_the_prompts_blocks(llm):
    """The engine takes all n samples in one add; the first computes the prompt, then the
    others take its full blocks from the prefix cache instead of computing their own."""
    engine, block = llm.engine, llm.engine.config.block_size
    prompt = list(range(100, 100 + 5 * block + 3))  # five full blocks and a partial one
    engine.add_request("s", prompt, SamplingParams(n=64, max_tokens=2, ignore_eos=True))
    assert sorted(engine.requests) == sorted(f"s-{k}" for k in range(64))
    hits = engine.stats().prefix_cache_hits
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
        used = engine.stats().num_total_blocks - engine.stats().num_free_blocks
        # Unshared, the 64 prompts would hold 64 * 6 blocks; shared, 5 + one partial each.
        assert used <= 5 + 64, used
    assert len(finals) == 64 and all(len(o.outputs[0].token_ids) == 2 for o in finals)
    cached = sorted(o.num_cached_tokens for o in finals)
    assert cached == [0] + [5 * block] * 63
    assert engine.stats().prefix_cache_hits - hits == 63 * 5 * block
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "blocks leaked"


def test_aborting_samples_frees_every_block(llm):
    engine = llm.engine
    engine.add_request("a", list(range(200, 260)), SamplingParams(n=8, max_tokens=100))
    for _ in range(3):
        engine.step()
    assert len(engine.scheduler.running) == 8
    engine.abort_request([f"a-{k}" for k in range(8)])
    finals = [o for o in engine.step() if o.finished]
    assert sorted(o.request_id for o in finals) == [f"a-{k}" for k in range(8)]
    assert {o.outputs[0].finish_reason for o in finals} == {"abort"}
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert not engine.requests and stats.num_free_blocks == stats.num_total_blocks
