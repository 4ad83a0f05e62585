"""What a Hugging Face config says beyond the fields every decoder has: the fields refused
because the engine would not honour them, and each family's switches (windows, Gemma's norms
and soft caps, partial rotary, experts, RoPE), read into ``ModelConfig``. No torch."""
from __future__ import annotations

from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")

SUPPORTED_ACTIVATIONS = ("silu", "swish", "gelu_pytorch_tanh", "gelu")


def refuse_unhonoured_fields(hf_config: Any, arch: str) -> None:
    """Raise ValueError naming the first config field this engine would not honour: a model
    that loads must be the model its config describes, never a silently different one."""
    def field(name: str) -> Any:
        return getattr(hf_config, name, None)

    kinds = set(field("layer_types") or ()) - set(LAYER_TYPES)
    if kinds:
        raise ValueError(f"layer_types {sorted(kinds)} are not supported; supported: "
                         f"{', '.join(LAYER_TYPES)}")
    if field("quantization_config"):  # a method or layout the linears do not hold: refused
        from nanoserve.layers.quantization.spec import parse_quantization_config

        method = parse_quantization_config(field("quantization_config")).method
        experts = field("num_experts") or field("num_local_experts")
        if method == "mxfp4" and arch != "GptOssForCausalLM":
            raise ValueError(f"quantization_config (mxfp4) is not supported for {arch}: "
                             "it is read for GptOssForCausalLM's experts only")
        if method not in ("gguf", "mxfp4") and experts:
            raise ValueError(f"quantization_config ({method}) is not supported for {arch}: "
                             "experts load 16- and 32-bit float (or GPT-OSS's MXFP4) weights "
                             "only")
    act = activation(hf_config)
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"hidden_act={act!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ACTIVATIONS)}")
    partial = partial_rotary(hf_config)
    if partial != 1.0 and arch not in PARTIAL_ROTARY:
        raise ValueError(f"partial_rotary_factor={partial} is not supported for {arch}: RoPE "
                         f"rotates every dimension")
    # Gemma 3 carries attention soft-capping in its config, but transformers never applies it.
    capped = {"Gemma2ForCausalLM": ("attn_logit_softcapping", "final_logit_softcapping"),
              "Gemma3ForCausalLM": ("final_logit_softcapping",)}.get(arch, ())
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if field(name) is not None and name not in capped:
            raise ValueError(f"{name}={field(name)} is not supported for {arch}")
    if field("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True is not supported: attention is causal")
    if field("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")
    # Qwen2's q/k/v biases are its architecture's; elsewhere attention_bias also biases o_proj.
    if field("attention_bias") and arch not in ("Qwen2ForCausalLM", "GptOssForCausalLM"):
        raise ValueError(f"attention_bias=True is not supported for {arch}")


LAYER_TYPES = ("full_attention", "sliding_attention")


GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# The architectures whose RoPE honours partial_rotary_factor in transformers.
PARTIAL_ROTARY = ("Phi3ForCausalLM",)


def partial_rotary(hf_config: Any) -> float:
    rope = getattr(hf_config, "rope_parameters", None)
    partial = getattr(hf_config, "partial_rotary_factor", None) or (
        rope.get("partial_rotary_factor") if isinstance(rope, dict) else None)
    return float(partial or 1.0)


def window_fields(hf_config: Any) -> dict[str, Any]:
    """``layer_types`` as the config lists them (Mistral lists none: every layer slides when
    it has a window) and the window, 0 where none applies or ``use_sliding_window`` is off."""
    window = getattr(hf_config, "sliding_window", None) or 0
    if getattr(hf_config, "use_sliding_window", None) is False:
        window = 0
    if window >= getattr(hf_config, "max_position_embeddings", window + 1):
        window = 0  # a window as long as the context: full attention
    types = getattr(hf_config, "layer_types", None) or (
        ["sliding_attention"] * hf_config.num_hidden_layers if window else [])
    return dict(layer_types=tuple(types), sliding_window=int(window))


def gemma_fields(hf_config: Any) -> dict[str, Any]:
    """Gemma 2 and 3's switches: (1 + w) sandwich norms, scaled embeddings, GeGLU, soft caps."""
    return dict(
        hidden_act=activation(hf_config), norm_plus_one=True, sandwich_norms=True,
        embed_scale=float(hf_config.hidden_size) ** 0.5,
        query_pre_attn_scalar=float(hf_config.query_pre_attn_scalar),
        attn_softcap=float(getattr(hf_config, "attn_logit_softcapping", None) or 0.0),
        final_softcap=float(getattr(hf_config, "final_logit_softcapping", None) or 0.0))


def gpt_oss_fields(hf_config: Any) -> dict[str, Any]:
    """GPT-OSS's switches: attention sinks, biased q/k/v/o, routers and experts, the softmax
    over the top-k logits, the clamped SwiGLU."""
    bias = bool(getattr(hf_config, "attention_bias", True))
    # Older transformers' GptOssConfig has no swiglu_alpha: its model used GPT-OSS's 1.702.
    return dict(o_proj_bias=bias, attention_sinks=True, moe_bias=True,
                moe_topk_first=True, swiglu_alpha=float(getattr(hf_config, "swiglu_alpha", 1.702)),
                swiglu_limit=float(getattr(hf_config, "swiglu_limit", 7.0)))


def activation(hf_config: Any) -> str:
    return (getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", None)
            or "silu")


def sparse_layers(hf_config: Any, num_experts: int) -> tuple[int, ...]:
    """Qwen3-MoE's rule: every ``decoder_sparse_step``-th layer, less ``mlp_only_layers``."""
    if num_experts == 0:
        return ()
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    return tuple(i for i in range(hf_config.num_hidden_layers)
                 if i not in dense and (i + 1) % step == 0)


def arch_from_model_type(hf_config: Any) -> str:
    """The model class for a config that names only its model_type (GGUF configs do)."""
    names = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
             "mistral": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM",
             "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
             "phi3": "Phi3ForCausalLM", "gpt_oss": "GptOssForCausalLM",
             "deepseek_v2": "DeepseekV2ForCausalLM"}
    return names.get(getattr(hf_config, "model_type", ""), str(hf_config.model_type))


def ropes_of(hf_config: Any) -> tuple[float, dict[str, Any] | None,
                                       tuple[float, dict[str, Any] | None] | None]:
    """(theta, scaling) of the full-attention layers, then the sliding layers' own (theta,
    scaling) where the config gives them apart (``rope_parameters`` keyed by layer type)."""
    params = dict(getattr(hf_config, "rope_parameters", None)
                  or getattr(hf_config, "rope_scaling", None) or {})
    if isinstance(params.get("full_attention"), dict):
        full = _rope_of(hf_config, dict(params["full_attention"]))
        sliding = params.get("sliding_attention")
        return *full, None if sliding is None else _rope_of(hf_config, dict(sliding))
    return *_rope_of(hf_config, params), None


def _rope_of(hf_config: Any, params: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    theta = float(params.pop("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    for name in ("mscale", "mscale_all_dim"):  # only YaRN (and DeepSeek's scale) reads them
        if params.get(name) and rope_type != "yarn":
            raise ValueError(f"rope {name}={params[name]} is not supported with rope type "
                             f"{rope_type!r}, only with 'yarn'")
    return theta, None if rope_type == "default" else {**params, "rope_type": rope_type}
