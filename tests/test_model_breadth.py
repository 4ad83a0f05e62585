"""Model breadth: each newer architecture (Mistral, Mixtral, Gemma 2/3, Phi-3, GPT-OSS), built
tiny by transformers' own config class with its features on (a sliding window shorter than the
prompts, soft-capping, experts, partial rotary, sinks, RoPE scalings), gives transformers'
greedy tokens, token for token, on the CPU in fp32."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from reference import PROMPTS, greedy_params, hf_greedy
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanoserve import LLM, SamplingParams

NEW_TOKENS = 32
WINDOW = 6  # shorter than most prompts, and than every prompt with its continuation
SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6)


PHI3_ROPE = {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
             "short_factor": [1.0, 1.3, 2.1, 3.7], "long_factor": [1.5, 4.0, 9.0, 17.0]}


def _config(arch: str, vocab_size: int, eos_id: int):
    import transformers as tf

    common = dict(SHAPE, vocab_size=vocab_size, eos_token_id=eos_id)
    if arch == "mistral":  # with YaRN scaling
        return tf.MistralConfig(**common, sliding_window=WINDOW, tie_word_embeddings=False,
                                rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                 "rope_theta": 1e4,
                                                 "original_max_position_embeddings": 128})
    if arch == "mixtral":  # 8 experts, top 2, with a window and dynamic NTK scaling too
        return tf.MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2,
                                sliding_window=WINDOW, tie_word_embeddings=True,
                                rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                 "rope_theta": 1e4})
    if arch == "phi3":  # fused qkv / gate_up, half the head rotated, longrope (short factors)
        return tf.Phi3Config(**common, sliding_window=WINDOW, tie_word_embeddings=False,
                             original_max_position_embeddings=128, pad_token_id=None,
                             rope_parameters=PHI3_ROPE)
    gemma = dict(common, layer_types=["sliding_attention", "full_attention"],
                 sliding_window=WINDOW, query_pre_attn_scalar=24, final_logit_softcapping=5.0)
    if arch == "gemma2":
        return tf.Gemma2Config(**gemma, attn_logit_softcapping=2.0)
    if arch == "gemma3":  # q/k norms; local and global layers rotate by different bases
        return tf.Gemma3TextConfig(**gemma, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}})
    if arch == "gpt-oss":  # sinks, biases, top-k then softmax, clamped SwiGLU, YaRN, windows
        return tf.GptOssConfig(**dict(common, intermediate_size=48), num_local_experts=4,
                               num_experts_per_tok=2, sliding_window=WINDOW,
                               tie_word_embeddings=False, rope_parameters={
                                   "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                   "original_max_position_embeddings": 128, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "truncate": False})
    raise ValueError(arch)


ARCHS = ["mistral", "mixtral", "gemma2", "gemma3", "phi3", "gpt-oss"]


def build(arch: str, out_dir: Path, tokenizer_dir: Path) -> Path:
    """A random ``arch`` model (weights wider than the init: less flat logits), saved."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return save_random(_config(arch, len(tok), tok.eos_token_id), out_dir, tokenizer_dir)


def save_random(config, out_dir: Path, tokenizer_dir: Path) -> Path:
    """A random model of transformers ``config`` (wide weights, norms near 1), saved with the
    tokenizer at ``tokenizer_dir``."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0).add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module", params=ARCHS)
def case(request, tmp_path_factory, tokenizer_dir):
    """(model folder, prompt ids, transformers' greedy continuations)."""
    path = build(request.param, tmp_path_factory.mktemp(request.param), tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = [AutoTokenizer.from_pretrained(path).encode(p) for p in PROMPTS]
    return path, ids, hf_greedy(model, ids, NEW_TOKENS)


def generate(llm: LLM, ids: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(ids, greedy_params(NEW_TOKENS), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_outputs_match_transformers(case):
    path, ids, want = case
    assert max(len(i) for i in ids) > WINDOW
    llm = LLM(str(path), device="cpu", dtype="float32")
    try:
        assert generate(llm, ids) == want
    finally:
        llm.close()


@pytest.mark.parametrize("case", ARCHS, indirect=True)
def test_sliding_window_under_preemption_chunking_and_prefix_hits(case):
    """One small engine: chunked prefills (7-token budget), preemption (12 blocks of 8), then
    the same prompts again, their full blocks now prefix-cache hits."""
    check_squeezed(*case)


@pytest.mark.parametrize("case", ["mistral"], indirect=True)
def test_sliding_window_frees_the_blocks_it_passed(case):
    """Every layer slides: a sequence holds the blocks of its window and of one step's tokens,
    never its whole length, so a cache far smaller than one sequence serves them all (one at
    a time), with transformers' tokens; a prompt run again hits the blocks of its window,
    whatever became of those before it."""
    path, ids, want = case
    llm = LLM(str(path), device="cpu", dtype="float32", max_num_batched_tokens=7,
              num_kv_blocks=6, block_size=4)
    scheduler = llm.engine.scheduler
    longest = max(len(i) for i in ids) + NEW_TOKENS
    assert scheduler.bm.blocks_needed(longest) > 2 * scheduler.bm.num_blocks
    held = []
    schedule = scheduler.schedule

    def watched(*args, **kwargs):
        out = schedule(*args, **kwargs)
        held.extend(len(c.request.block_table) - c.request.num_slid_blocks for c in out.chunks)
        return out

    scheduler.schedule = watched
    try:
        assert generate(llm, ids) == want
        one = greedy_params(1)
        for prompt, tokens in zip(ids, want):  # one token: its window's blocks stay cached
            assert llm.generate([prompt], one, use_tqdm=False)[0].outputs[0].token_ids == \
                tokens[:1]
            hits = llm.engine.stats().prefix_cache_hits
            again = llm.generate([prompt], one, use_tqdm=False)[0].outputs[0].token_ids
            assert again == tokens[:1]
            # every full block before the last token's counts, the slid ones too
            assert llm.engine.stats().prefix_cache_hits - hits == (len(prompt) - 1) // 4 * 4
    finally:
        llm.close()
    # window 6 + a 7-token step span at most 4 blocks of 4, plus the last registered one
    assert held and max(held) <= 5
    assert scheduler.bm.num_free_blocks == scheduler.bm.num_blocks


def check_squeezed(path, ids: list[list[int]], want: list[list[int]]) -> None:
    """Greedy outputs stay ``want`` in an engine that must chunk prefills (7-token budget) and
    preempt (12 blocks of 8), then again, and with the prompts' full blocks as prefix-cache
    hits: each prompt twice in a row, alone (together, a window's freed blocks are soon
    reused)."""
    assert max(len(i) for i in ids) > 7
    llm = LLM(str(path), device="cpu", dtype="float32", max_num_batched_tokens=7,
              num_kv_blocks=12, block_size=8)
    try:
        assert generate(llm, ids) == want
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0 and stats.num_partial_prefills > 0
        hits = stats.prefix_cache_hits
        assert generate(llm, ids) == want
        for prompt, tokens in zip(ids, want):
            assert generate(llm, [prompt, prompt]) == [tokens, tokens]
        assert llm.engine.stats().prefix_cache_hits > hits
    finally:
        llm.close()


@pytest.mark.parametrize("case", ["gemma2"], indirect=True)
def test_final_soft_cap_shapes_the_logprobs(case):
    """Greedy tokens cannot see a monotone cap on the logits; the log-probabilities do."""
    path, ids, _ = case
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids[3]])).logits[0, -1]
    assert logits.abs().max() < model.config.final_logit_softcapping  # capped
    want = torch.log_softmax(logits, -1).topk(5)
    llm = LLM(str(path), device="cpu", dtype="float32")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
        got = llm.generate([ids[3]], params, use_tqdm=False)[0].outputs[0].logprobs[0]
    finally:
        llm.close()
    assert list(got) == want.indices.tolist()
    torch.testing.assert_close(torch.tensor(list(got.values())), want.values,
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["gemma2"], indirect=True)
def test_folded_norm_weights_keep_gemma_outputs(case):
    """The GPU path folds each pre-norm's (1 + w) into the projection reading it, never a
    post-norm; run here on the CPU's unfused ops, the model is still transformers'."""
    path, ids, want = case
    llm = LLM(str(path), device="cpu", dtype="float32")
    try:
        model = llm.engine.executor.model
        model.fold_norm_weights()
        layer = model.model.layers[0]
        assert layer.input_layernorm.folded and layer.pre_feedforward_layernorm.folded
        assert not (layer.post_attention_layernorm.folded
                    or layer.post_feedforward_layernorm.folded)
        assert generate(llm, ids) == want
    finally:
        llm.close()


LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 128,
            "short_factor": PHI3_ROPE["short_factor"], "long_factor": PHI3_ROPE["long_factor"],
            "partial_rotary_factor": 0.5}


@pytest.mark.parametrize("family,rope,positions", [
    ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
     (0, 500)),
    ("llama", {"rope_type": "dynamic", "factor": 2.0}, (0, 500)),
    ("phi3", LONGROPE, (0, 120)),  # below the original length: the short factors
    ("phi3", LONGROPE, (128, 500)),  # from it: the long ones
])
def test_rope_tables_equal_transformers_rotary_embedding(family, rope, positions):
    """The cos/sin rows against transformers' own rotary module (Phi-3's rotating half of
    each 16-wide head), at positions where it uses the factors being tested."""
    import transformers as tf
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from nanoserve.config import ModelConfig
    from nanoserve.layers.rotary import RotaryEmbedding

    config_cls, rotary_cls = {"llama": (tf.LlamaConfig, LlamaRotaryEmbedding),
                              "phi3": (tf.Phi3Config, Phi3RotaryEmbedding)}[family]
    extra = dict(original_max_position_embeddings=128, pad_token_id=None) \
        if family == "phi3" else {}
    hf_config = config_cls(**SHAPE, vocab_size=32, **extra,
                           rope_parameters={**rope, "rope_theta": 1e4})
    hf_config.architectures = [f"{config_cls.__name__[:-6]}ForCausalLM"]
    cfg = ModelConfig.from_hf(hf_config)
    ours = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, *cfg.rope_of(0),
                           rotary_dim=cfg.rotary_dim).cos_sin
    pos = torch.arange(*positions)
    cos, sin = rotary_cls(hf_config)(torch.zeros(1, dtype=torch.float32), pos[None])
    half = cos.shape[-1] // 2
    assert ours.shape == (512, 2 * half) and half == (4 if family == "phi3" else 8)
    torch.testing.assert_close(ours[pos], torch.cat([cos[0, :, :half], sin[0, :, :half]], -1),
                               atol=2e-6, rtol=0)


@pytest.mark.parametrize("case", ARCHS, indirect=True)
def test_two_ranks_match_one(case):
    """Tensor parallelism (gloo) over the new layers: Phi-3's fused tensors sliced per rank,
    GPT-OSS's sinks split by heads and its biases added once, Mixtral's experts, Gemma's
    cache groups on each rank; the top-5 rule at a near tie."""
    from test_tensor_parallel import assert_same_greedy
    from test_tensor_parallel import generate as tp_generate

    path, ids, _ = case
    one = tp_generate(path, ids[:4], 16)
    assert_same_greedy(one, tp_generate(path, ids[:4], 16, tensor_parallel_size=2))
