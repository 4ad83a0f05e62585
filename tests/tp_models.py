"""Tiny random models shaped to exercise tensor parallelism at 2 and 4 ranks.

All have 4 or 8 query heads (divisible by 4). The llama model's vocabulary does not divide by 2
or 4 (the vocab-parallel layers pad it); qwen2 has one KV head (replicated at every TP size) and
tied embeddings; qwen3 has 4 KV heads (split at TP=4, not replicated) and per-head q/k norms;
qwen3-moe is qwen3 with 8 experts (top 2) in its first layer, their intermediate features split.
"""
from __future__ import annotations

from pathlib import Path

import torch

TP_MODELS = {
    "llama": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_extra=3,
                  tie_word_embeddings=False),
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_extra=0,
                  tie_word_embeddings=True),
    "qwen3": dict(num_attention_heads=8, num_key_value_heads=4, head_dim=16, vocab_extra=0,
                  tie_word_embeddings=False),
    "qwen3-moe": dict(num_attention_heads=8, num_key_value_heads=4, head_dim=16, vocab_extra=0,
                      tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]),
}


def build_tp_model(arch: str, out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A random ``arch`` model shaped as in TP_MODELS, saved with SmolLM2's tokenizer."""
    from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config,
                              Qwen3Config, Qwen3MoeConfig)

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    shape = dict(TP_MODELS[arch])
    vocab_size = len(tok) + shape.pop("vocab_extra")
    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
                  "qwen3-moe": Qwen3MoeConfig}[arch]
    config = config_cls(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        max_position_embeddings=512, rms_norm_eps=1e-6, vocab_size=vocab_size,
                        eos_token_id=tok.eos_token_id, **shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():  # wider than the init: less flat logits
            if "norm" in name:
                p.fill_(1.0).add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return out_dir
