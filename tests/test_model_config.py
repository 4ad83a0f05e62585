"""Config fields the engine cannot honour are refused at load, naming the field; configs that
carry such fields with values the engine does honour still load."""
from __future__ import annotations

import json
import shutil

import pytest
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from nanoserve import LLM
from nanoserve.config import ModelConfig

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=100, max_position_embeddings=256)


@pytest.mark.parametrize("config,field", [
    (LlamaConfig(**SMALL, sliding_window=64, layer_types=["chunked_attention"]),
     "layer_types"),
    (LlamaConfig(**SMALL, quantization_config={"quant_method": "awq", "bits": 4}),
     "quantization_config"),
    (LlamaConfig(**SMALL, hidden_act="relu"), "hidden_act"),
    (LlamaConfig(**SMALL, partial_rotary_factor=0.5), "partial_rotary_factor"),
    (LlamaConfig(**SMALL, final_logit_softcapping=30.0), "final_logit_softcapping"),
    (LlamaConfig(**SMALL, attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (LlamaConfig(**SMALL, mlp_bias=True), "mlp_bias"),
    (LlamaConfig(**SMALL, attention_bias=True), "attention_bias"),
    (Qwen3Config(**SMALL, attention_bias=True), "attention_bias"),
    (LlamaConfig(**SMALL, rope_scaling={"rope_type": "proportional", "factor": 4.0}),
     "proportional"),
])
def test_an_unhonoured_field_is_refused_by_name(config, field):
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(config)


@pytest.mark.parametrize("config", [
    Qwen2Config(**SMALL, sliding_window=256, use_sliding_window=False),  # Qwen2.5's layout
    Qwen2Config(**SMALL, sliding_window=64, use_sliding_window=False),
    MistralConfig(**SMALL, sliding_window=None),  # Mistral v0.2 and later
    MistralConfig(**SMALL, sliding_window=256),  # a window as long as the context
    MistralConfig(**SMALL, sliding_window=64),  # honoured: tests/test_model_breadth.py
    Qwen2Config(**SMALL, sliding_window=64, use_sliding_window=True, max_window_layers=0),
    LlamaConfig(**SMALL, hidden_act="silu", partial_rotary_factor=1.0),
    # what transformers writes for a GGUF file it read: the weights come dequantized
    LlamaConfig(**SMALL, quantization_config={"quant_method": "gguf"}),
    Qwen3Config(**SMALL),
])
def test_fields_at_values_the_engine_honours_load(config):
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    assert ModelConfig.from_hf(config).hidden_size == 64


def test_sliding_windows_follow_layer_types():
    """Mistral's window covers every layer; Qwen2's only the layers from max_window_layers."""
    def windows(config):
        cfg = ModelConfig.from_hf(config)
        return [cfg.window_of(i) for i in range(cfg.num_layers)]

    assert windows(MistralConfig(**dict(SMALL, num_hidden_layers=2), sliding_window=8)) == [8, 8]
    qwen2 = Qwen2Config(**dict(SMALL, num_hidden_layers=3), sliding_window=8,
                        use_sliding_window=True, max_window_layers=1)
    assert windows(qwen2) == [0, 8, 8]


def test_a_model_folder_with_an_unknown_layer_type_is_refused(tiny_llama, tmp_path):
    """Through the public API: a layer kind the decoder does not build is named."""
    folder = tmp_path / "chunked"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(sliding_window=8, layer_types=["chunked_attention", "full_attention"])
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="chunked_attention"):
        LLM(str(folder), device="cpu", dtype="float32")
