"""The architectures nanoserve runs, all on its one decoder (``decoder.py``)."""
from __future__ import annotations

from nanoserve.attention.backend import AttentionBackend
from nanoserve.config import ModelConfig
from nanoserve.models.decoder import DecoderForCausalLM

ARCHITECTURES = ("DeepseekV2ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                 "GptOssForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def build_model(cfg: ModelConfig, backend: AttentionBackend) -> DecoderForCausalLM:
    _supported(cfg.architecture)
    return DecoderForCausalLM(cfg, backend)


def check_architecture(hf_config: object) -> str:
    """The config's architecture name, or a clear error listing what is supported."""
    names = getattr(hf_config, "architectures", None) or []
    return _supported(names[0] if names
                      else f"<model_type {getattr(hf_config, 'model_type', '?')}>")


def _supported(arch: str) -> str:
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} is not supported; "
                         f"supported: {', '.join(sorted(ARCHITECTURES))}")
    return arch
