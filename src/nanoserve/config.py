"""Engine and model configuration: validated user arguments and a normalised model description."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanoserve.sampling_params import MAX_LOGPROBS, check_int

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
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    seed: int = 0
    load_format: str = "auto"  # "dummy": random weights, for benchmarks of a config's shape
    max_n: int = 128  # most samples (n, best_of) one request may ask for
    max_logprobs: int = MAX_LOGPROBS  # most top logprobs per token a request may ask for
    # Admission control: add_request refuses a request (EngineOverloadedError; the server's
    # 503) while this many wait beyond the batch's free seats. None: no bound.
    max_waiting_requests: int | None = None
    # "embed": the model makes embeddings (prefill only, pooled); "auto": embed when the
    # folder is a sentence-transformers model (modules.json with a Pooling module).
    task: str = "auto"
    pooling_type: str | None = None  # "last" | "mean" | "cls"; None: the model's own

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size",
                     "tensor_parallel_size", "max_n"):
            check_int(name, getattr(self, name), 1)
        for name in ("max_model_len", "num_kv_blocks", "kv_cache_memory", "max_waiting_requests"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        check_int("seed", self.seed, 0)
        check_int("max_logprobs", self.max_logprobs, 0)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        for name, allowed in (("dtype", ("auto", "float32", "float16", "bfloat16")),
                              ("kv_cache_dtype", KV_CACHE_DTYPES),
                              ("load_format", ("auto", "dummy")),
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


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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
    # Mixture of experts (Qwen3-MoE): 0 experts means every layer has a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is a mixture of experts

    @classmethod
    def from_hf(cls, hf_config: Any, extra_eos_ids: list[int] | None = None) -> ModelConfig:
        arch = (getattr(hf_config, "architectures", None) or [arch_from_model_type(hf_config)])[0]
        refuse_unhonoured_fields(hf_config, arch)
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        theta, scaling = _rope_of(hf_config)
        eos = as_id_list(getattr(hf_config, "eos_token_id", None)) + list(extra_eos_ids or [])
        # transformers >= 4.56 names it dtype and warns on every read of torch_dtype.
        dtype = (hf_config.dtype if hasattr(hf_config, "dtype")
                 else getattr(hf_config, "torch_dtype", None))
        num_experts = int(getattr(hf_config, "num_experts", None)
                          or getattr(hf_config, "num_local_experts", None) or 0)
        return cls(
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
            attention_bias=arch == "Qwen2ForCausalLM",
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            torch_dtype=str(dtype).replace("torch.", "") if dtype else "float32",
            eos_token_ids=sorted(set(eos)),
            num_experts=num_experts,
            num_experts_per_tok=int(getattr(hf_config, "num_experts_per_tok", 0) or 0),
            moe_intermediate_size=int(getattr(hf_config, "moe_intermediate_size", 0) or 0),
            norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),
            moe_layers=_moe_layers(hf_config, num_experts),
        )


SUPPORTED_ACTIVATIONS = ("silu", "swish")


def refuse_unhonoured_fields(hf_config: Any, arch: str) -> None:
    """Raise ValueError naming the first config field this engine would not honour: a model
    that loads must be the model its config describes, never a silently different one."""
    def field(name: str) -> Any:
        return getattr(hf_config, name, None)

    window = field("sliding_window")
    if (window is not None and field("use_sliding_window") is not False
            and window < getattr(hf_config, "max_position_embeddings", window + 1)):
        raise ValueError(f"sliding_window={window} is not supported: nanoserve runs full "
                         f"attention only")
    quantization = field("quantization_config")
    method = (quantization.get("quant_method", "?") if isinstance(quantization, dict)
              else getattr(quantization, "quant_method", "?")) if quantization else None
    # transformers marks what it read from a GGUF file "gguf": weights dequantized as they load.
    if method is not None and str(method).lower() != "gguf":
        raise ValueError(f"quantization_config ({method}) is not supported: nanoserve loads "
                         f"16- and 32-bit float weights")
    act = field("hidden_act")
    if act is not None and act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"hidden_act={act!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ACTIVATIONS)}")
    rope = field("rope_parameters")
    partial = field("partial_rotary_factor") or (
        rope.get("partial_rotary_factor") if isinstance(rope, dict) else None)
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={partial} is not supported: RoPE rotates "
                         f"every dimension")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if field(name) is not None:
            raise ValueError(f"{name}={field(name)} is not supported")
    if field("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")
    # Qwen2's q/k/v biases are its architecture's; elsewhere attention_bias also biases o_proj.
    if field("attention_bias") and arch != "Qwen2ForCausalLM":
        raise ValueError(f"attention_bias=True is not supported for {arch}")


def _moe_layers(hf_config: Any, num_experts: int) -> tuple[int, ...]:
    """Qwen3-MoE's rule: every ``decoder_sparse_step``-th layer, less ``mlp_only_layers``."""
    if num_experts == 0:
        return ()
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    return tuple(i for i in range(hf_config.num_hidden_layers)
                 if i not in dense and (i + 1) % step == 0)


def max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """The longest sequence served: the user's limit, never past the model's positions."""
    return min(config.max_model_len or model_config.max_position_embeddings,
               model_config.max_position_embeddings)


def arch_from_model_type(hf_config: Any) -> str:
    """The model class for a config that names only its model_type (GGUF configs do)."""
    names = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
             "mistral": "LlamaForCausalLM"}
    return names.get(getattr(hf_config, "model_type", ""), str(hf_config.model_type))


def _rope_of(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    params = dict(getattr(hf_config, "rope_parameters", None)
                  or getattr(hf_config, "rope_scaling", None) or {})
    theta = float(params.pop("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return theta, None if rope_type == "default" else {**params, "rope_type": rope_type}


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
