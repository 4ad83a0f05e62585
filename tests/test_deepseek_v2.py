"""DeepSeek-V2: multi-head latent attention (q through a LoRA bottleneck or plain, a latent
KV cache, absorbed decode), its mixture of experts (a dense first layer, shared experts,
group-limited routing, scaled weights) and YaRN with mscale, built tiny by transformers'
config class, give transformers' greedy tokens on the CPU in fp32; the cache holds one
latent row per token and layer; unsupported fields are refused by name."""
from __future__ import annotations

import pytest
import torch
from reference import PROMPTS, hf_greedy
from test_model_breadth import NEW_TOKENS, check_squeezed, generate, save_random
from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV2Config

from nanoserve import LLM
from nanoserve.config import ModelConfig

MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
SHAPE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4,
             max_position_embeddings=512, rms_norm_eps=1e-6, n_routed_experts=8,
             moe_intermediate_size=32, num_experts_per_tok=2, **MLA)
YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "mscale": 0.707,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 128, "beta_fast": 32.0,
        "beta_slow": 1.0}
CASES = {
    # q via q_lora_rank; a dense first layer; two shared experts; each token's two experts
    # from the one group (of two) holding the best, weights scaled; YaRN with both mscales.
    "lora-grouped-yarn": dict(q_lora_rank=24, num_hidden_layers=3, first_k_dense_replace=1,
                              n_shared_experts=2, topk_method="group_limited_greedy",
                              n_group=2, topk_group=1, routed_scaling_factor=1.5,
                              rope_parameters=YARN),
    # plain q_proj, experts in every layer, greedy routing, default RoPE.
    "plain-q": dict(q_lora_rank=None, num_hidden_layers=2, first_k_dense_replace=0,
                    n_shared_experts=1, topk_method="greedy",
                    rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
}


def hf_config(vocab_size: int = 64, eos_id: int = 0, **fields) -> DeepseekV2Config:
    config = DeepseekV2Config(**{**SHAPE, **fields}, vocab_size=vocab_size,
                              eos_token_id=eos_id, tie_word_embeddings=False)
    config.architectures = ["DeepseekV2ForCausalLM"]
    return config


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory, tokenizer_dir):
    """(model folder, prompt ids, transformers' greedy continuations)."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = hf_config(len(tok), tok.eos_token_id, **CASES[request.param])
    path = save_random(config, tmp_path_factory.mktemp(request.param), tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = [tok.encode(p) for p in PROMPTS]
    return path, ids, hf_greedy(model, ids, NEW_TOKENS)


def test_greedy_outputs_match_transformers(case):
    path, ids, want = case
    llm = LLM(str(path), device="cpu", dtype="float32")
    try:
        assert generate(llm, ids) == want
        cfg = llm.engine.executor.model_config
        layers = llm.engine.executor.model.model.layers
        assert [type(layer.mlp).__name__ for layer in layers] == [
            "MLP" if i < cfg.num_layers - len(cfg.moe_layers) else "SharedExpertsMoeBlock"
            for i in range(cfg.num_layers)]
    finally:
        llm.close()


@pytest.mark.parametrize("case", ["lora-grouped-yarn"], indirect=True)
def test_cache_holds_one_latent_row_per_token(case):
    """Each layer caches kv_lora_rank + qk_rope_head_dim values per token, in one tensor that
    keys and values both read, and the runner sizes its blocks by that."""
    path, ids, want = case
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=8)
    try:
        runner = llm.engine.executor
        width = MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]
        for attn in runner.attention:
            assert attn.k_cache.shape == (runner.num_kv_blocks, 8, 1, width)
            assert attn.v_cache is attn.k_cache
        assert runner._bytes_per_block() == 8 * width * 4 * len(runner.attention)
        assert generate(llm, ids[:2]) == want[:2]
        # What the cache holds is the normalised latent and the rotated key part.
        assert runner.attention[0].k_cache.abs().sum() > 0
    finally:
        llm.close()


@pytest.mark.parametrize("case", list(CASES), indirect=True)
def test_chunked_prefill_preemption_and_prefix_hits(case):
    """Prefills in 7-token chunks (longer prompts than that), preemption (12 blocks of 8),
    then the same prompts again, their full blocks now prefix-cache hits."""
    check_squeezed(*case)


def test_absorbed_decode_equals_decompressed_attention():
    """The decode form (q absorbed through kv_b's key half, out through its value half) equals
    attention over keys and values decompressed from the same paged latents (float64)."""
    from nanoserve.attention.metadata import AttentionMetadata
    from nanoserve.attention.mla_reference import mla_decode, mla_prefill, store_latent

    gen = torch.Generator().manual_seed(0)
    heads, nope, rope, rank, v_dim, block = 3, 8, 4, 16, 6, 4

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    seq_lens = [5, 11, 1]
    tables = torch.tensor([[2, 6, 0], [1, 4, 5], [3, 0, 0]], dtype=torch.int32)
    cache = torch.zeros(8, block, 1, rank + rope, dtype=torch.float64)
    slots = torch.cat([tables[i, torch.arange(n) // block].long() * block + torch.arange(n) % block
                       for i, n in enumerate(seq_lens)])
    store_latent(rand(len(slots), rank), rand(len(slots), rope), cache, slots)
    meta = AttentionMetadata(torch.tensor([0, 1, 2, 3], dtype=torch.int32),
                             torch.tensor(seq_lens, dtype=torch.int32),
                             torch.full((3,), -1, dtype=torch.int64), tables, 1, max(seq_lens))
    q_nope, q_rope, kv_b = rand(3, heads, nope), rand(3, heads, rope), rand(heads * (nope + v_dim), rank)
    got = mla_decode(q_nope, q_rope, cache, meta, kv_b, v_dim, 0.3)
    want = mla_prefill(q_nope, q_rope, cache, meta, kv_b, v_dim, 0.3)
    assert got.shape == (3, heads, v_dim)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_grouped_routing_keeps_to_the_best_groups():
    """group_limited_greedy picks every token's experts within its top groups, which plain
    top-k over all experts does not; weights are the scores times the scaling factor."""
    from nanoserve.hf_deepseek import ExpertRouting
    from nanoserve.layers.moe_router import GroupedRouter

    torch.manual_seed(0)
    grouped = GroupedRouter(16, 8, 2, ExpertRouting(n_group=4, topk_group=1, scaling=2.0))
    grouped.weight.normal_()
    x = torch.randn(64, 16)
    weights, experts = grouped(x)
    scores = torch.softmax(x @ grouped.weight.t(), -1)
    best_group = scores.view(64, 4, 2).amax(-1).argmax(-1)
    assert (experts // 2 == best_group[:, None]).all()
    torch.testing.assert_close(weights, 2.0 * scores.gather(1, experts))
    assert (torch.topk(scores, 2).indices.sort().values != experts.sort().values).any()


def test_moe_layer_freq_and_first_dense_layers():
    cfg = ModelConfig.from_hf(hf_config(num_hidden_layers=6, first_k_dense_replace=1,
                                        moe_layer_freq=2))
    assert cfg.moe_layers == (2, 4)
    assert cfg.mla.kv_lora_rank == 32 and cfg.mla.cache_width == 40


def test_yarn_mscale_all_dim_sharpens_the_softmax():
    """transformers' scale: qk_head_dim^-1/2 times (0.1 * mscale_all_dim * ln(factor) + 1)^2."""
    import math

    cfg = ModelConfig.from_hf(hf_config(num_hidden_layers=1, rope_parameters=YARN))
    assert cfg.mla.softmax_scale == pytest.approx(24 ** -0.5 * (0.1 * math.log(4.0) + 1) ** 2)
    plain = ModelConfig.from_hf(hf_config(num_hidden_layers=1))
    assert plain.mla.softmax_scale == pytest.approx(24 ** -0.5)


@pytest.mark.parametrize("fields,named", [
    (dict(norm_topk_prob=True), "norm_topk_prob"),
    (dict(topk_method="noaux_tc"), "topk_method"),
    (dict(scoring_func="sigmoid"), "scoring_func"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(topk_method="group_limited_greedy", n_group=3, topk_group=1), "n_group"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                           "mscale_all_dim": 1.0}), "mscale_all_dim"),
])
def test_unsupported_fields_are_refused_by_name(fields, named):
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_hf(hf_config(num_hidden_layers=2, **fields))


def test_backend_without_latent_attention_is_refused():
    """A backend with no MLA kernels: building the layer on it fails, naming the way out (both
    of today's backends have them)."""
    from nanoserve.attention.torch_backend import TorchAttentionBackend
    from nanoserve.attention.triton_backend import TritonAttentionBackend
    from nanoserve.layers.mla import MLAttention

    class PlainBackend:
        attention = TorchAttentionBackend.attention

    cfg = ModelConfig.from_hf(hf_config(num_hidden_layers=1))
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        MLAttention(cfg, backend, 0)
    with pytest.raises(ValueError, match="device='cpu'"):
        MLAttention(cfg, PlainBackend(), 0)


@pytest.mark.parametrize("case", ["lora-grouped-yarn"], indirect=True)
def test_two_ranks_match_one(case):
    """Tensor parallelism (gloo): heads, kv_b and the experts split, the latent projections,
    the router and the latent cache whole on each rank; the top-5 rule at a near tie."""
    from test_tensor_parallel import assert_same_greedy
    from test_tensor_parallel import generate as tp_generate

    path, ids, _ = case
    one = tp_generate(path, ids[:4], 16)
    assert_same_greedy(one, tp_generate(path, ids[:4], 16, tensor_parallel_size=2))
