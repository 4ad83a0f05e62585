"""Greedy outputs equal transformers' token for token, under every scheduling regime."""
from __future__ import annotations

import pytest
import torch
from reference import PROMPTS, greedy_params, hf_greedy, hf_model_and_prompts
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanoserve import LLM
from nanoserve.layers.norm import RMSNorm

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def expected(tiny_model):
    model, ids = hf_model_and_prompts(tiny_model)
    return ids, hf_greedy(model, ids, NEW_TOKENS)


def _generate(path, ids, **engine_args):
    llm = LLM(str(path), device="cpu", dtype="float32", **engine_args)
    outs = llm.generate(ids, greedy_params(NEW_TOKENS), use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "blocks leaked"
    return [o.outputs[0].token_ids for o in outs], stats


def test_default_engine_matches_transformers(tiny_model, expected):
    ids, want = expected
    got, stats = _generate(tiny_model, ids)
    assert got == want
    assert stats.num_preemptions == 0


def test_preemption_keeps_outputs_exact(tiny_model, expected):
    ids, want = expected
    got, stats = _generate(tiny_model, ids, num_kv_blocks=12, block_size=8)
    assert stats.num_preemptions > 0
    assert got == want


def test_chunked_prefill_keeps_outputs_exact(tiny_model, expected):
    ids, want = expected
    got, stats = _generate(tiny_model, ids, max_num_batched_tokens=7)
    assert stats.num_partial_prefills > 0
    assert got == want


def test_linear_rope_scaling_matches_transformers(tmp_path, tokenizer_dir):
    from conftest import build_tiny_model

    path = build_tiny_model("llama-linear-rope", tmp_path / "linear", tokenizer_dir)
    model, ids = hf_model_and_prompts(path)
    got, _ = _generate(path, ids)
    assert got == hf_greedy(model, ids, NEW_TOKENS)


def test_prefix_cache_hits_keep_outputs_exact(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    shared = tok.encode("You are a helpful assistant. Answer briefly and truthfully. " * 4)
    ids = [shared + tok.encode(q, add_special_tokens=False)
           for q in (" Who?", " What is the sea?", " When", " Where is it?")]
    want = hf_greedy(model, ids, NEW_TOKENS)
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", block_size=8)
    first = llm.generate(ids[:1], greedy_params(NEW_TOKENS), use_tqdm=False)
    rest = llm.generate(ids[1:], greedy_params(NEW_TOKENS), use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits >= 3 * (len(shared) // 8) * 8
    assert all(o.num_cached_tokens > 0 for o in rest)
    assert [o.outputs[0].token_ids for o in first + rest] == want


def test_smollm2_gguf_matches_transformers(smollm2_path):
    model = AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name,
                                                 dtype=torch.float32)
    # Dequantized at load, as transformers does (kept quantized: tests/test_quantization.py).
    llm = LLM(str(smollm2_path), device="cpu", dtype="float32", quantization="none")
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    want = hf_greedy(model, ids, NEW_TOKENS)
    outs = llm.generate(ids, greedy_params(NEW_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert "Paris" in outs[0].outputs[0].text


def test_offline_token_budget_defaults_above_the_servers(tiny_llama):
    """LLM takes vLLM's offline budget unless told otherwise; EngineConfig (the server's and
    the CLI's) keeps the smaller one."""
    from nanoserve.config import EngineConfig
    from nanoserve.llm import OFFLINE_MAX_NUM_BATCHED_TOKENS

    assert OFFLINE_MAX_NUM_BATCHED_TOKENS > EngineConfig().max_num_batched_tokens
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32")
    assert llm.engine.scheduler.max_num_batched_tokens == OFFLINE_MAX_NUM_BATCHED_TOKENS
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", max_num_batched_tokens=64)
    assert llm.engine.scheduler.max_num_batched_tokens == 64


def test_reset_prefix_cache_makes_a_repeated_prompt_compute_again(tiny_llama):
    """A repeated prompt hits the prefix cache; after ``reset_prefix_cache`` it does not, and
    its output is unchanged (greedy)."""
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", block_size=4)
    prompt = list(range(3, 40))

    def run() -> tuple[list[int], int]:
        hits = llm.engine.stats().prefix_cache_hits
        out = llm.generate([prompt], greedy_params(4), use_tqdm=False)[0].outputs[0].token_ids
        return out, llm.engine.stats().prefix_cache_hits - hits

    first, first_hits = run()
    again, again_hits = run()
    assert first_hits == 0 and again_hits > 0 and again == first
    assert llm.reset_prefix_cache()
    after, after_hits = run()
    assert after_hits == 0 and after == first


def test_norm_weights_folded_into_projections_keep_outputs_exact(tiny_model, expected):
    """The GPU path folds each layer's pre-norm weights into the qkv and gate/up columns and
    keeps unit norms; the same model folded on the CPU must still equal transformers."""
    ids, want = expected
    llm = LLM(str(tiny_model), device="cpu", dtype="float32")
    model = llm.engine.executor.model
    layer = model.model.layers[0]
    g = layer.input_layernorm.weight.clone()
    w = layer.self_attn.qkv_proj.weight.clone()
    model.fold_norm_weights()
    assert layer.input_layernorm.folded and layer.post_attention_layernorm.folded
    assert torch.equal(layer.input_layernorm.weight, torch.ones_like(g))
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight, w * g[None, :])
    assert not model.model.norm.folded  # the LM head may be the embedding: the final norm stays
    # A folded norm is the projection's to apply (``linear(..., norm_eps=)``): no norm module
    # runs but the final one.
    calls: list[str] = []
    hooks = [module.register_forward_pre_hook(lambda mod, args, name=name: calls.append(name))
             for name, module in model.named_modules() if isinstance(module, RMSNorm)
             and module.weight.numel() == model.config.hidden_size]
    outs = llm.generate(ids, greedy_params(NEW_TOKENS), use_tqdm=False)
    for hook in hooks:
        hook.remove()
    assert [o.outputs[0].token_ids for o in outs] == want
    assert set(calls) == {"model.norm"}
