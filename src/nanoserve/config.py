"""Engine and model configuration: validated user arguments and a normalised model description."""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanoserve.layers.quantization.spec import QUANTIZATION_OPTIONS
from nanoserve.hf_fields import (GEMMA, PARTIAL_ROTARY, gemma_fields, gpt_oss_fields,
                                 partial_rotary,
                                 refuse_unhonoured_fields, ropes_of, sparse_layers,
                                 window_fields)
from nanoserve.hf_fields import arch_from_model_type  # noqa: F401  (the loader's import)
from nanoserve.hf_deepseek import DEEPSEEK_V2, ExpertRouting, MlaDims, deepseek_fields
from nanoserve.sampling_params import MAX_LOGPROBS, check_int
from nanoserve.spec_config import SpeculativeConfig

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass
class EngineConfig:
    """The `LLM(...)` arguments, validated; shared by the offline API, the CLI and the server."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    # "auto": the model's dtype; "fp8" (= "fp8_e4m3"): one unscaled byte per K/V value.
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # Layers that slide and layers that do not share one block table: a sliding layer keeps
    # every block of its sequence, as a full one does (attention/cache_spec.py).
    disable_hybrid_kv_cache_manager: bool = False
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    seed: int = 0
    load_format: str = "auto"  # "dummy": random weights, for benchmarks of a config's shape
    max_n: int = 128  # most samples (n, best_of) one request may ask for
    max_logprobs: int = MAX_LOGPROBS  # most top logprobs per token a request may ask for
    # Admission control: add_request refuses a request (EngineOverloadedError; the server's
    # 503) while this many wait beyond the batch's free seats. None: no bound.
    max_waiting_requests: int | None = None
    # The same bound on the tokens those waiting requests must compute (their prompts, each
    # sample counting its own); None: no bound.
    max_waiting_tokens: int | None = None
    # Speculative decoding (vLLM's): a dict, a JSON object (the CLI's) or a SpeculativeConfig.
    speculative_config: SpeculativeConfig | None = None
    # "auto": a quantized checkpoint's linear weights stay quantized (GGUF blocks, AWQ, GPTQ);
    # "none": they are dequantized at load into dtype.
    quantization: str = "auto"
    # "embed": the model makes embeddings (prefill only, pooled); "auto": embed when the
    # folder is a sentence-transformers model (modules.json with a Pooling module).
    task: str = "auto"
    pooling_type: str | None = None  # "last" | "mean" | "cls"; None: the model's own
    # torch threads on the CPU, split between tensor-parallel ranks; None: the cores free to
    # this process at start-up (runner/cpu_threads.py).
    cpu_threads: int | None = None

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size",
                     "tensor_parallel_size", "max_n"):
            check_int(name, getattr(self, name), 1)
        for name in ("max_model_len", "num_kv_blocks", "kv_cache_memory", "max_waiting_requests",
                     "max_waiting_tokens", "cpu_threads"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        check_int("seed", self.seed, 0)
        check_int("max_logprobs", self.max_logprobs, 0)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        for name, allowed in (("dtype", ("auto", "float32", "float16", "bfloat16")),
                              ("kv_cache_dtype", KV_CACHE_DTYPES),
                              ("load_format", ("auto", "dummy")),
                              ("quantization", QUANTIZATION_OPTIONS),
                              ("task", ("auto", "generate", "embed")),
                              ("pooling_type", (None, "last", "mean", "cls"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}, "
                                 f"got {getattr(self, name)!r}")
        gpu_util = self.gpu_memory_utilization
        if isinstance(gpu_util, bool) or not isinstance(gpu_util, (int, float)) or not (
                0.0 < gpu_util <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_util!r}")
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?",
                                                                self.device):
            raise ValueError("device must be 'auto', 'cpu', 'cuda' or 'cuda:N', "
                             f"got {self.device!r}")
        for name in ("enable_prefix_caching", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise ValueError(f"model must be a path or None, got {self.model!r}")



@dataclass
class ModelConfig:
    """What the runtime needs to know about a model, from a Hugging Face config of any layout
    (``rope_parameters`` or ``rope_theta`` + ``rope_scaling``, no ``head_dim``, ...)."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    torch_dtype: str
    eos_token_ids: list[int] = field(default_factory=list)
    # Mixture of experts (Qwen3-MoE, Mixtral): 0 experts means every layer has a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is a mixture of experts
    # Each layer's kind, "full_attention" or "sliding_attention" (empty: all full); a sliding
    # layer's query sees the last ``sliding_window`` positions, its own included (0: all).
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0
    # Sliding layers' own RoPE (theta, scaling), where it differs (Gemma 3's local base).
    sliding_rope: tuple[float, dict[str, Any] | None] | None = None
    # Gemma's switches (hf_fields.gemma_fields).
    hidden_act: str = "silu"
    norm_plus_one: bool = False  # RMSNorm scales by (1 + weight)
    sandwich_norms: bool = False  # norms before and after attention and the MLP
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden_size))
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2, not head_dim's
    attn_softcap: float = 0.0  # attention scores become cap * tanh(s / cap); 0: not capped
    final_softcap: float = 0.0  # the same on the logits
    rotary_dim: int = 0  # RoPE rotates each head's first rotary_dim features (0: all)
    # GPT-OSS's switches (hf_fields.gpt_oss_fields).
    o_proj_bias: bool = False
    attention_sinks: bool = False  # per head, one more logit in the softmax, with no value
    moe_bias: bool = False  # router and expert biases
    moe_topk_first: bool = False  # softmax over the top-k logits, not top-k of the softmax
    swiglu_alpha: float = 1.0
    swiglu_limit: float = 0.0  # > 0: the experts' clamped SwiGLU
    # DeepSeek-V2's switches (hf_deepseek.deepseek_fields): latent attention, grouped routing.
    mla: MlaDims | None = None
    routing: ExpertRouting | None = None

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def window_of(self, layer: int) -> int:
        """Layer ``layer``'s sliding window (0: full attention)."""
        return self.sliding_window if self.is_sliding(layer) else 0

    @property
    def layer_windows(self) -> list[int]:
        """Every layer's sliding window (0: full attention)."""
        return [self.window_of(i) for i in range(self.num_layers)]

    def rope_of(self, layer: int) -> tuple[float, dict[str, Any] | None]:
        """Layer ``layer``'s RoPE (theta, scaling)."""
        if self.sliding_rope is not None and self.is_sliding(layer):
            return self.sliding_rope
        return self.rope_theta, self.rope_scaling

    @classmethod
    def from_hf(cls, hf_config: Any, extra_eos_ids: list[int] | None = None) -> ModelConfig:
        arch = (getattr(hf_config, "architectures", None) or [arch_from_model_type(hf_config)])[0]
        refuse_unhonoured_fields(hf_config, arch)
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        theta, scaling, sliding_rope = ropes_of(hf_config)
        eos = as_id_list(getattr(hf_config, "eos_token_id", None)) + list(extra_eos_ids or [])
        # transformers >= 4.56 names it dtype and warns on every read of torch_dtype.
        dtype = (hf_config.dtype if hasattr(hf_config, "dtype")
                 else getattr(hf_config, "torch_dtype", None))
        num_experts = int(getattr(hf_config, "num_experts", None)
                          or getattr(hf_config, "num_local_experts", None) or 0)
        cfg = cls(
            architecture=arch,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            vocab_size=hf_config.vocab_size,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=getattr(hf_config, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or (
                arch == "GptOssForCausalLM" and bool(getattr(hf_config, "attention_bias", True))),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            torch_dtype=str(dtype).replace("torch.", "") if dtype else "float32",
            eos_token_ids=sorted(set(eos)),
            num_experts=num_experts,
            num_experts_per_tok=int(getattr(hf_config, "num_experts_per_tok", 0) or 0),
            # Mixtral's experts are intermediate_size wide, their top-k weights renormalised.
            moe_intermediate_size=int(getattr(hf_config, "moe_intermediate_size", 0) or (
                hf_config.intermediate_size if num_experts else 0)),
            norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob",
                                        arch == "MixtralForCausalLM")),
            moe_layers=sparse_layers(hf_config, num_experts),
            **window_fields(hf_config),
            sliding_rope=sliding_rope,
            **(gemma_fields(hf_config) if arch in GEMMA else {}),
            **(gpt_oss_fields(hf_config) if arch == "GptOssForCausalLM" else {}),
            rotary_dim=int(head_dim * partial_rotary(hf_config)) if arch in PARTIAL_ROTARY
            else 0,
        )
        if arch == DEEPSEEK_V2:
            cfg = dataclasses.replace(cfg, **deepseek_fields(hf_config, scaling))
        return cfg


def max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """The longest sequence served: the user's limit, never past the model's positions."""
    return min(config.max_model_len or model_config.max_position_embeddings,
               model_config.max_position_embeddings)


def as_id_list(value: Any) -> list[int]:
    """A token id field (absent, one id or several) as a list of ids."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def resolve_model_path(model: str | None) -> Path:
    """The local model folder or .gguf file; ``None`` means the packaged default model."""
    if model is None:
        from nanoserve.models.gguf import default_model_path
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist (nanoserve loads "
                                "local Hugging Face folders or .gguf files)")
    return path
