"""Model shapes the benchmarks run: real models' config.json fields, for random bf16 weights.

``DENSE`` are the dense shapes a general GPU path must be fast on, 0.5B to 14B: head_dim 64 and
128, GQA groups of 2 to 8 query heads per KV head, with and without q/k/v bias, q/k norms,
llama3 rope scaling, tied and untied LM heads. ``MOE`` are mixture-of-experts shapes, kept apart.
``make_model_dir`` writes a folder (config.json and a tokenizer) that
``LLM(folder, load_format="dummy")`` loads with random weights.

    python benchmarks/shapes.py list [--dense]
    python benchmarks/shapes.py write qwen3-8b /tmp/qwen3-8b [--layers 2]

Importable without torch.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

_QWEN2 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu",
              attention_dropout=0.0, bos_token_id=151643, eos_token_id=151643,
              initializer_range=0.02, rope_theta=1000000.0, torch_dtype="bfloat16",
              use_cache=True, use_sliding_window=False)
_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu",
              attention_bias=False, attention_dropout=0.0, bos_token_id=151643,
              eos_token_id=151645, head_dim=128, initializer_range=0.02,
              max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
              torch_dtype="bfloat16", use_cache=True, use_sliding_window=False,
              vocab_size=151936)
_LLAMA32 = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                attention_bias=False, attention_dropout=0.0, mlp_bias=False,
                bos_token_id=128000, eos_token_id=128001, initializer_range=0.02,
                max_position_embeddings=131072, pretraining_tp=1, rms_norm_eps=1e-5,
                rope_scaling=_LLAMA3_ROPE, rope_theta=500000.0, tie_word_embeddings=True,
                torch_dtype="bfloat16", use_cache=True, vocab_size=128256)

SHAPES: dict[str, dict] = {
    # Qwen2.5: q/k/v bias (implied by the architecture), no head_dim field (hidden / heads).
    "qwen2.5-0.5b": {**_QWEN2, **dict(  # GQA 7, head_dim 64, tied
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, max_window_layers=21,
        sliding_window=32768, rms_norm_eps=1e-6, tie_word_embeddings=True, vocab_size=151936)},
    "qwen3-0.6b": {**_QWEN3, **dict(  # GQA 2, head_dim 128 > hidden / heads, q/k norm, tied
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, max_window_layers=28, tie_word_embeddings=True)},
    "llama-3.2-1b": {**_LLAMA32, **dict(  # GQA 4, head_dim 64, llama3 rope, tied
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64)},
    "llama-3.2-3b": {**_LLAMA32, **dict(  # GQA 3, head_dim 128, tied
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
        num_key_value_heads=8, head_dim=128)},
    "qwen2.5-7b": {**_QWEN2, **dict(  # GQA 7, head_dim 128, bias, untied
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, max_position_embeddings=131072, max_window_layers=28,
        sliding_window=131072, rms_norm_eps=1e-6, tie_word_embeddings=False, vocab_size=152064)},
    "qwen3-8b": {**_QWEN3, **dict(  # GQA 4, untied
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, max_window_layers=36, tie_word_embeddings=False)},
    "qwen2.5-14b": {**_QWEN2, **dict(  # GQA 5, 48 layers, bias, untied
        hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
        num_key_value_heads=8, max_position_embeddings=131072, max_window_layers=48,
        sliding_window=131072, rms_norm_eps=1e-5, tie_word_embeddings=False, vocab_size=152064)},
    "qwen3-14b": {**_QWEN3, **dict(  # GQA 5, 40 layers, untied
        hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
        num_key_value_heads=8, max_window_layers=40, tie_word_embeddings=False)},
}

# Qwen3-30B-A3B: 48 layers, 128 experts of 768 features, top 8 (~61 GB in bf16).
SHAPES["qwen3-30b-a3b"] = {**_QWEN3, **dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
    intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_window_layers=48,
    output_router_logits=False, router_aux_loss_coef=0.001, tie_word_embeddings=False)}
# Its layers, 4 of them: routes like the real model, saves and loads within a device call.
SHAPES["qwen3-moe-small"] = {**SHAPES["qwen3-30b-a3b"], "num_hidden_layers": 4}

# Newer families (issue 43), from their config.json on the Hub.
SHAPES["gemma-2-2b"] = dict(  # sandwich (1 + w) norms, GeGLU, soft caps, alternating windows
    architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_size=2304,
    intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
    head_dim=256, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
    sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
    max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=256000,
    tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0,
    torch_dtype="bfloat16")
SHAPES["gemma-3-1b"] = dict(  # q/k norms, 5 local (512) : 1 global, two RoPE bases, MQA
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=1152,
    intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
    head_dim=256, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
    sliding_window=512, sliding_window_pattern=6, rope_theta=1000000.0,
    rope_local_base_freq=10000.0, max_position_embeddings=32768, rms_norm_eps=1e-6,
    vocab_size=262144, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1,
    pad_token_id=0, torch_dtype="bfloat16")
SHAPES["phi-3-mini-4k"] = dict(  # fused qkv / gate_up checkpoints, MHA, a 2047-key window
    architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=3072,
    intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, hidden_act="silu", max_position_embeddings=4096,
    original_max_position_embeddings=4096, sliding_window=2047, rms_norm_eps=1e-5,
    rope_theta=10000.0, rope_scaling=None, vocab_size=32064, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=32000, pad_token_id=32000, torch_dtype="bfloat16")
SHAPES["mixtral-8x7b"] = dict(  # 8 experts of 14336 features, top 2
    architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, hidden_act="silu",
    max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0,
    sliding_window=None, vocab_size=32000, tie_word_embeddings=False, bos_token_id=1,
    eos_token_id=2, torch_dtype="bfloat16")
# Its layers, 4 of them (~12 GB in bf16).
SHAPES["mixtral-small"] = {**SHAPES["mixtral-8x7b"], "num_hidden_layers": 4}
# GPT-OSS-20B in bf16 (the Hub's checkpoint is MXFP4, not loaded yet): sinks, biases, 128-key
# windows on every other layer, 32 experts top 4 with the clamped SwiGLU, YaRN.
SHAPES["gpt-oss-20b"] = dict(
    architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880,
    intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
    head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 12, attention_bias=True,
    swiglu_limit=7.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                  "truncate": False, "original_max_position_embeddings": 4096},
    rope_theta=150000.0, vocab_size=201088, tie_word_embeddings=False, eos_token_id=200002,
    pad_token_id=199999, hidden_act="silu", torch_dtype="bfloat16")
SHAPES["gpt-oss-small"] = {**SHAPES["gpt-oss-20b"], "num_hidden_layers": 4,
                           "layer_types": ["sliding_attention", "full_attention"] * 2}
# DeepSeek-V2-Lite: MLA (a 512-wide latent and 64 rotated features a token in the cache), 64
# experts top 6 with 2 shared, a dense first layer, YaRN.
SHAPES["deepseek-v2-lite"] = dict(
    architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=2048,
    intermediate_size=10944, num_hidden_layers=27, num_attention_heads=16,
    num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2,
    num_experts_per_tok=6, moe_intermediate_size=1408, first_k_dense_replace=1,
    topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0,
    norm_topk_prob=False, hidden_act="silu", rms_norm_eps=1e-6, vocab_size=102400,
    max_position_embeddings=163840, tie_word_embeddings=False, bos_token_id=100000,
    eos_token_id=100001, torch_dtype="bfloat16",
    rope_parameters={"rope_type": "yarn", "factor": 40.0, "rope_theta": 10000.0,
                     "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                     "beta_slow": 1.0})
FAMILIES = ["gemma-2-2b", "gemma-3-1b", "phi-3-mini-4k", "mixtral-small", "gpt-oss-small",
            "deepseek-v2-lite"]

# The dense shapes, smallest first: what latency.py and throughput.py run by default.
DENSE = ["qwen2.5-0.5b", "qwen3-0.6b", "llama-3.2-1b", "llama-3.2-3b", "qwen2.5-7b", "qwen3-8b",
         "qwen2.5-14b"]
MOE = ["qwen3-30b-a3b", "qwen3-moe-small"]


def shrunk(shape: dict, hidden_size: int = 64, head_dim: int = 16, kv_heads: int = 1,
           layers: int = 2, intermediate_size: int = 128) -> dict:
    """``shape`` at a size the CPU runs in milliseconds, keeping what distinguishes it: its
    architecture, GQA group, bias, q/k norm, rope scaling, tied head, experts (fewer), and a
    head_dim field or none (then hidden_size is heads * head_dim)."""
    group = shape["num_attention_heads"] // shape["num_key_value_heads"]
    small = {**shape, "hidden_size": hidden_size, "num_hidden_layers": layers,
             "intermediate_size": intermediate_size, "head_dim": head_dim,
             "num_attention_heads": group * kv_heads, "num_key_value_heads": kv_heads}
    if "head_dim" not in shape:
        del small["head_dim"]
        small["hidden_size"] = group * kv_heads * head_dim
    if "max_window_layers" in small:
        small["max_window_layers"] = layers
    if shape.get("num_experts"):
        small.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    if shape.get("num_local_experts"):  # Mixtral, GPT-OSS: experts intermediate_size wide
        small.update(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32)
    if "layer_types" in small:
        small["layer_types"] = small["layer_types"][:layers]
    return small


# Tiny shapes for host-side benchmarks and CPU checks: the model forward costs next to nothing.
SHAPES["tiny-qwen3"] = {**SHAPES["qwen3-0.6b"], **dict(
    hidden_size=64, num_hidden_layers=1, intermediate_size=128, head_dim=32,
    num_attention_heads=2, num_key_value_heads=1, max_window_layers=1)}
for _name, _like in (("tiny-qwen2", "qwen2.5-0.5b"), ("tiny-llama", "llama-3.2-1b"),
                     ("tiny-qwen3-moe", "qwen3-30b-a3b"), ("tiny-gemma2", "gemma-2-2b"),
                     ("tiny-phi3", "phi-3-mini-4k"), ("tiny-mixtral", "mixtral-8x7b"),
                     ("tiny-gpt-oss", "gpt-oss-20b")):
    SHAPES[_name] = shrunk(SHAPES[_like])
SHAPES["tiny-gemma3"] = shrunk(SHAPES["gemma-3-1b"], layers=6)  # 5 sliding : 1 full

# Qwen3's real tokenizer (scripts/fetch_qwen3_tokenizer.sh, run in a checkout: relative to the
# working directory); ignored by git, so a device call has it only where the call carries
# `.cache/qwen3-tokenizer`.
QWEN3_TOKENIZER_DIR = Path(os.environ.get("NANOSERVE_QWEN3_TOKENIZER",
                                          ".cache/qwen3-tokenizer"))


def config_of(shape: str | dict, num_hidden_layers: int | None = None) -> dict:
    """The config dict of a shape (by name or as a dict), with its layers overridden if asked."""
    config = dict(SHAPES[shape] if isinstance(shape, str) else shape)
    if num_hidden_layers is not None:
        config["num_hidden_layers"] = num_hidden_layers
        if "layer_types" in config:
            config["layer_types"] = config["layer_types"][:num_hidden_layers]
        if "max_window_layers" in config:
            config["max_window_layers"] = num_hidden_layers
    return config


def make_model_dir(shape: str | dict, out: Path, tokenizer_dir: Path | None = None, *,
                   num_hidden_layers: int | None = None) -> Path:
    """A model folder for ``load_format="dummy"``: the shape's config.json and a tokenizer.

    The tokenizer is Qwen3's real one where ``tokenizer_dir`` (default: .cache/qwen3-tokenizer)
    holds it, so that detokenizing costs what it does for a real model; otherwise a word-level
    tokenizer of the shape's vocabulary, one made-up word per id, written here (stderr says so).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = config_of(shape, num_hidden_layers)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    source = Path(tokenizer_dir) if tokenizer_dir is not None else QWEN3_TOKENIZER_DIR
    if (source / "tokenizer.json").is_file():
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (source / name).is_file():
                shutil.copy(source / name, out / name)
    else:
        print(f"shapes.py: no tokenizer in {source}; writing a word-level one of "
              f"{config['vocab_size']} ids", file=sys.stderr)
        write_synthetic_tokenizer(out, config["vocab_size"])
    return out


def tokenizer_kind(model_dir: Path) -> str:
    """"qwen3" or "synthetic": which tokenizer ``make_model_dir`` put in the folder."""
    return "synthetic" if (Path(model_dir) / "synthetic_tokenizer").exists() else "qwen3"


def write_synthetic_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer whose ids 0..vocab_size-1 are the words ``t0``, ``t1``, ..."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)},
                                           unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0",
         "model_max_length": 1 << 20}))
    (out / "synthetic_tokenizer").write_text("written by benchmarks/shapes.py\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("list", help="print the shape names, one a line")
    listing.add_argument("--dense", action="store_true", help="only the default dense shapes")
    write = sub.add_parser("write", help="write a model folder for a shape")
    write.add_argument("shape", choices=sorted(SHAPES))
    write.add_argument("out", type=Path)
    write.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    args = parser.parse_args(argv)
    if args.command == "list":
        print("\n".join(DENSE if args.dense else sorted(SHAPES)))
    else:
        print(make_model_dir(args.shape, args.out, num_hidden_layers=args.layers))


if __name__ == "__main__":
    main()
