"""Maps a config's architecture name to the model class that runs it."""
from __future__ import annotations

from torch import nn

from nanoserve.attention.backend import AttentionBackend
from nanoserve.config import ModelConfig
from nanoserve.models.decoder import DecoderForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": DecoderForCausalLM,
    "MistralForCausalLM": DecoderForCausalLM,
    "Qwen2ForCausalLM": DecoderForCausalLM,
    "Qwen3ForCausalLM": DecoderForCausalLM,
    "Qwen3MoeForCausalLM": DecoderForCausalLM,
}


def build_model(cfg: ModelConfig, backend: AttentionBackend) -> nn.Module:
    return MODEL_CLASSES[_supported(cfg.architecture)](cfg, backend)


def check_architecture(hf_config: object) -> str:
    """The config's architecture name, or a clear error listing what is supported."""
    names = getattr(hf_config, "architectures", None) or []
    return _supported(names[0] if names
                      else f"<model_type {getattr(hf_config, 'model_type', '?')}>")


def _supported(arch: str) -> str:
    if arch not in MODEL_CLASSES:
        raise ValueError(f"architecture {arch!r} is not supported; "
                         f"supported: {', '.join(sorted(MODEL_CLASSES))}")
    return arch
