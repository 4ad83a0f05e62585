"""The hybrid KV cache: a model that mixes sliding-window and full layers keeps a block table
per group of layers, so its sliding layers hold only their window's blocks; tokens stay
transformers' (CPU, fp32), on a cache that could not hold the same sequences otherwise."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from reference import PROMPTS, greedy_params, hf_greedy
from test_model_breadth import SHAPE, WINDOW, save_random
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanoserve import LLM, SamplingParams
from nanoserve.attention.cache_spec import cache_groups

NEW_TOKENS = 24


def test_groups_split_layers_by_window_into_equal_runs():
    # Gemma 3's pattern (every 6th layer full) over 26 layers: runs of 4 (the full count)
    windows = [0 if (i + 1) % 6 == 0 else 512 for i in range(26)]
    groups = cache_groups(windows)
    assert groups.windows == (0,) + (512,) * 6 and groups.num_slots == 4
    assert groups.layers[0] == (5, 11, 17, 23)
    assert sorted(i for layers in groups.layers for i in layers) == list(range(26))
    for g, layers in enumerate(groups.layers):
        assert all(windows[i] == groups.windows[g] for i in layers)
        assert len(layers) <= groups.num_slots
    assert cache_groups([0] * 4).layers == ((0, 1, 2, 3),)
    assert cache_groups([8] * 3).windows == (8,)
    assert cache_groups(windows, hybrid=False).windows == (0,)  # every block kept


def save_gemma3(out_dir: Path, tokenizer_dir: Path) -> Path:
    """A random 4-layer Gemma 3 (three sliding layers, then a full one: four groups of one
    layer), saved."""
    import transformers as tf

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = tf.Gemma3TextConfig(
        **dict(SHAPE, num_hidden_layers=4), vocab_size=len(tok), eos_token_id=tok.eos_token_id,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], sliding_window=WINDOW,
        query_pre_attn_scalar=24, final_logit_softcapping=5.0)
    return save_random(config, out_dir, tokenizer_dir)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, tokenizer_dir) -> tuple[Path, list[list[int]], list[list[int]]]:
    """(model folder, prompt ids, transformers' greedy continuations)."""
    path = save_gemma3(tmp_path_factory.mktemp("gemma3"), tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = [AutoTokenizer.from_pretrained(path).encode(p) for p in PROMPTS]
    return path, ids, hf_greedy(model, ids, NEW_TOKENS)


def _generate(path: Path, ids: list[list[int]], **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), device="cpu", dtype="float32", **kwargs)
    outs = llm.generate(ids, greedy_params(NEW_TOKENS), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def test_hybrid_cache_gives_transformers_tokens_on_a_fraction_of_the_memory(gemma3):
    path, ids, want = gemma3
    budget = 4 * 2**20
    got, llm = _generate(path, ids, kv_cache_memory=budget)
    try:
        assert got == want
        assert llm.engine.scheduler.windows == (0, WINDOW, WINDOW, WINDOW)
        hybrid_blocks = llm.engine.block_manager.num_blocks
    finally:
        llm.close()
    got, llm = _generate(path, ids, kv_cache_memory=budget, disable_hybrid_kv_cache_manager=True)
    try:
        assert got == want
        assert llm.engine.scheduler.windows == (0,)
        # a block id holds one layer's block, not four: four times the ids
        assert hybrid_blocks == 4 * llm.engine.block_manager.num_blocks
    finally:
        llm.close()


def test_sliding_groups_free_what_the_window_passed(gemma3):
    """In a cache of 32 blocks of 4 tokens the longest sequence would need 4 x 11 blocks with
    one table for all layers; with a table per group it needs its full layer's 11 and the
    window's few per sliding group, and gets transformers' tokens under chunked prefills,
    preemption and prefix hits."""
    path, ids, want = gemma3
    longest = max(len(i) for i in ids) + NEW_TOKENS
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=32, block_size=4,
              max_num_batched_tokens=7)
    scheduler = llm.engine.scheduler
    assert 4 * scheduler.bm.blocks_needed(longest) > scheduler.bm.num_blocks
    held: list[list[int]] = []
    schedule = scheduler.schedule

    def watched(*args, **kwargs):
        out = schedule(*args, **kwargs)
        held.extend([len(h) for h in scheduler.held_blocks(c.request)] for c in out.chunks)
        return out

    scheduler.schedule = watched
    try:
        outs = llm.generate(ids, greedy_params(NEW_TOKENS), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0 and stats.num_partial_prefills > 0
        hits = stats.prefix_cache_hits
        for prompt, tokens in zip(ids, want):  # alone: its blocks stay cached for the next
            for _ in range(2):
                out = llm.generate([prompt], greedy_params(NEW_TOKENS), use_tqdm=False)
                assert out[0].outputs[0].token_ids == tokens
        assert llm.engine.stats().prefix_cache_hits > hits
    finally:
        llm.close()
    # window 6 + a 7-token step span at most 4 blocks of 4, plus the last registered one
    assert max(max(h[1:]) for h in held) <= 5
    assert max(h[0] for h in held) == scheduler.bm.blocks_needed(longest - 1)
    assert scheduler.bm.num_free_blocks == scheduler.bm.num_blocks


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_rolls_back_every_group(gemma3, method):
    """Rejected proposals' blocks go back from each group's table; a draft model (here the
    target itself) keeps one table a sequence beside the target's groups."""
    path, ids, _ = gemma3
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    spec = {"method": method, "num_speculative_tokens": 3, "disable_when_slower": False}
    spec.update({"prompt_lookup_min": 1, "prompt_lookup_max": 2} if method == "ngram"
                else {"model": str(path)})
    outs = []
    for speculative_config in (None, spec):
        llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64, block_size=4,
                  speculative_config=speculative_config)
        try:
            outs.append([o.outputs[0].token_ids
                         for o in llm.generate(ids, params, use_tqdm=False)])
            bm = llm.engine.block_manager
            assert bm.num_free_blocks == bm.num_blocks
        finally:
            llm.close()
    assert outs[1] == outs[0]
    stats = llm.engine.spec.stats
    assert stats.num_draft_tokens > 0
    if method == "ngram":  # some were rejected (the draft, the target itself, never is)
        assert stats.num_accepted_tokens < stats.num_draft_tokens


def test_layers_that_cache_differently_are_refused_a_shared_tensor(gemma3, monkeypatch):
    """A slot's tensor serves a layer of every group: layers whose caches differ in shape
    cannot share one, and the error names the way out."""
    from nanoserve.attention.cache_spec import CacheSpec
    from nanoserve.models.decoder import Attention

    monkeypatch.setattr(Attention, "cache_spec", property(
        lambda self: CacheSpec(self.num_kv_heads, self.head_dim * (2 if self.window else 1))))
    with pytest.raises(ValueError, match="disable_hybrid_kv_cache_manager=True"):
        LLM(str(gemma3[0]), device="cpu", dtype="float32")
