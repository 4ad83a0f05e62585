"""Model folders of real shapes with random bf16 weights, saved by transformers, for the GPU
parity tests (both engines then load the very same tensors)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

QWEN3_TOKENIZER_DIR = Path(__file__).resolve().parents[2] / ".cache" / "qwen3-tokenizer"

_COMMON = dict(torch_dtype="bfloat16", hidden_act="silu", rms_norm_eps=1e-6)
_QWEN = dict(_COMMON, rope_theta=1e6, max_position_embeddings=40960, vocab_size=151936,
             eos_token_id=151645, bos_token_id=151643)

# Config fields of each shape; the layer counts are the real models' unless named otherwise.
SHAPES = {
    "qwen3-0.6b": dict(_QWEN, architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                       hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                       tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN, architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                     hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                     tie_word_embeddings=False),
    # head_dim 64, GQA 7, q/k/v biases, widths that are no power of two.
    "qwen2.5-0.5b": dict(_QWEN, architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                         hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, head_dim=64, intermediate_size=4864,
                         tie_word_embeddings=True, max_position_embeddings=32768),
    # head_dim 64, llama3 rope scaling.
    "llama-1b": dict(_COMMON, architectures=["LlamaForCausalLM"], model_type="llama",
                     hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, intermediate_size=8192,
                     vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                     rms_norm_eps=1e-5, max_position_embeddings=131072,
                     rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192},
                     eos_token_id=128001, bos_token_id=128000),
    # Qwen3-30B-A3B's layer (128 experts, top 8, 768 features each) in 4 layers.
    "qwen3-moe-small": dict(_QWEN, architectures=["Qwen3MoeForCausalLM"],
                            model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=4,
                            num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                            intermediate_size=6144, moe_intermediate_size=768,
                            num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                            decoder_sparse_step=1, mlp_only_layers=[],
                            tie_word_embeddings=False),
}


from nanoserve.bench.shapes import SHAPES as BENCHMARK_SHAPES  # noqa: E402

# Newer families (issue 43) at their real sizes; windows shortened and layers cut where said, so
# that prompts of a few hundred tokens cross the windows and a parity run stays short.
SHAPES.update({
    "gemma-2-2b": BENCHMARK_SHAPES["gemma-2-2b"],
    "gemma-2-2b-window256": {**BENCHMARK_SHAPES["gemma-2-2b"], "sliding_window": 256,
                             "num_hidden_layers": 8},
    "gemma-3-1b": BENCHMARK_SHAPES["gemma-3-1b"],  # its real 512-key window
    "phi-3-mini-4k-window256": {**BENCHMARK_SHAPES["phi-3-mini-4k"], "sliding_window": 256,
                                "num_hidden_layers": 8},
    "mixtral-small": BENCHMARK_SHAPES["mixtral-small"],
    "gpt-oss-small": BENCHMARK_SHAPES["gpt-oss-small"],  # its real 128-key windows, 4 layers
    # Phi-4-mini's shape (partial rotary 0.75, longrope) in 8 layers; its long/short factor
    # lists are made up here (48 values each, as its 96 rotated features need).
    "phi-4-mini-8l": dict(_COMMON, architectures=["Phi3ForCausalLM"], model_type="phi3",
                          hidden_size=3072, intermediate_size=8192, num_hidden_layers=8,
                          num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                          partial_rotary_factor=0.75, vocab_size=200064,
                          max_position_embeddings=131072,
                          original_max_position_embeddings=4096, rms_norm_eps=1e-5,
                          rope_scaling={"rope_type": "longrope",
                                        "short_factor": [1.0 + 0.02 * i for i in range(48)],
                                        "long_factor": [1.0 + 0.5 * i for i in range(48)]},
                          rope_theta=10000.0, tie_word_embeddings=True, sliding_window=None,
                          bos_token_id=199999, eos_token_id=199999, pad_token_id=199999),
    "deepseek-v2-lite-4l": {**BENCHMARK_SHAPES["deepseek-v2-lite"], "num_hidden_layers": 4},
})


def save_random_hf_model(shape: str, out: Path, seed: int = 0) -> Path:
    """``out`` holding ``shape``'s config, Qwen3's tokenizer (a word-level one where
    `.cache/qwen3-tokenizer` is missing) and random bf16 weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(SHAPES[shape], indent=1))
    if (QWEN3_TOKENIZER_DIR / "tokenizer.json").is_file():
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(QWEN3_TOKENIZER_DIR / name, out / name)
    else:  # prompts are token ids: any tokenizer of the vocabulary's size serves
        from nanoserve.bench.shapes import write_synthetic_tokenizer
        write_synthetic_tokenizer(out, SHAPES[shape]["vocab_size"])
    config = AutoConfig.from_pretrained(out)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    return out
