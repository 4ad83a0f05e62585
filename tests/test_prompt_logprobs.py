"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers' logits on the same
fp32 weights, through chunked prefill, preemption and prefix-cache hits."""
from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from reference import hf_model_and_prompts

TOP = 3


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Prompt ids and, per prompt, transformers' log-softmax at every position."""
    model, ids = hf_model_and_prompts(tiny_model)
    with torch.no_grad():
        logprobs = [model(torch.tensor([p])).logits[0].log_softmax(-1) for p in ids]
    return ids, logprobs


def prompt_logprobs(path, ids, max_tokens=3, **engine_args):
    llm = LLM(str(path), device="cpu", dtype="float32", **engine_args)
    params = SamplingParams(prompt_logprobs=TOP, max_tokens=max_tokens, min_tokens=max_tokens,
                            temperature=0.0)
    outs = llm.generate(ids, params, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "blocks leaked"
    return [o.prompt_logprobs for o in outs], stats


def check_against(reference, got):
    ids, want = reference
    for prompt, lps, entries in zip(ids, want, got, strict=True):
        assert len(entries) == len(prompt) and entries[0] is None
        for pos in range(1, len(prompt)):
            entry, expected = entries[pos], lps[pos - 1]  # position p - 1 predicts token p
            top_ids = expected.topk(TOP).indices.tolist()
            assert set(entry) == {prompt[pos], *top_ids}
            for token, value in entry.items():
                assert value == pytest.approx(expected[token].item(), abs=1e-4)


def test_prompt_logprobs_equal_transformers(tiny_model, reference):
    got, _ = prompt_logprobs(tiny_model, reference[0])
    check_against(reference, got)


def test_chunked_prefill_and_preemption_keep_them(tiny_model, reference):
    got, stats = prompt_logprobs(tiny_model, reference[0], max_num_batched_tokens=7)
    assert stats.num_partial_prefills > 0
    check_against(reference, got)
    # Preempted while decoding, a request computes its prompt again: reported once all the same.
    got, stats = prompt_logprobs(tiny_model, reference[0], max_tokens=32, num_kv_blocks=12,
                                 block_size=8)
    assert stats.num_preemptions > 0
    check_against(reference, got)


def test_a_cached_prefix_is_computed_again(tiny_llama):
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", block_size=4)
    prompt = list(range(5, 30))
    plain = llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
    with_logprobs = SamplingParams(max_tokens=2, prompt_logprobs=0)
    first, second = (llm.generate([prompt], with_logprobs, use_tqdm=False)[0] for _ in range(2))
    assert len(second.prompt_logprobs) == len(prompt) and second.prompt_logprobs[0] is None
    assert [set(e) for e in second.prompt_logprobs[1:]] == [{t} for t in prompt[1:]]
    for a, b in zip(first.prompt_logprobs[1:], second.prompt_logprobs[1:]):
        assert list(b.values()) == pytest.approx(list(a.values()), abs=1e-5)
    assert llm.generate([prompt], SamplingParams(max_tokens=2),
                        use_tqdm=False)[0].num_cached_tokens > 0, "the prefix cache still works"


def test_n_samples_share_them_and_bad_values_are_refused(tiny_llama):
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32")
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(n=2, prompt_logprobs=1, max_tokens=2,
                                                      seed=3), use_tqdm=False)[0]
    assert len(out.outputs) == 2 and len(out.prompt_logprobs) == 4
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(ValueError, match="prompt_logprobs must be <= 20"):  # max_logprobs
        llm.generate("Hi", SamplingParams(prompt_logprobs=21), use_tqdm=False)
