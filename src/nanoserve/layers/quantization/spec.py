"""Which quantization a checkpoint asks for, read from its ``quantization_config`` (or its being a
GGUF file) and checked against what the engine implements. Torch-free: the config layer uses it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# EngineConfig.quantization: "auto" keeps a checkpoint's quantized weights quantized; "none"
# dequantizes them at load into the engine's dtype (the reference the kept form is tested on);
# "fp8" quantizes a 16-bit checkpoint at load (per-channel weights, per-token activations).
QUANTIZATION_OPTIONS = ("auto", "none", "fp8")
SUPPORTED_METHODS = ("awq", "compressed-tensors", "fp8", "gguf", "gptq", "mxfp4")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what PyTorch's packed-int4 kernel takes


@dataclass(frozen=True)
class QuantSpec:
    """A checkpoint's weight quantization: the method and the fields its layout depends on.
    ``dequantize``: unpack at load into dense weights of the engine's dtype."""

    method: str
    bits: int = 4
    group_size: int = 0
    desc_act: bool = False  # GPTQ act-order: input features grouped through g_idx
    zero_offset: int = 0  # GPTQ v1 checkpoints store zero points minus one
    dequantize: bool = False
    # FP8 (W8A8, dynamic activation scales): how the weight scales go, "block" (a scale per
    # weight_block of [out, in] features), "channel" or "tensor"; "online": quantized at load.
    fp8_scales: str = ""
    weight_block: tuple[int, int] = (0, 0)


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def parse_quantization_config(config: Any) -> QuantSpec:
    """The QuantSpec of a Hugging Face ``quantization_config`` (dict or transformers object);
    ValueError naming the method or field the engine does not implement."""
    method = str(_get(config, "quant_method", "?")).lower()
    if method not in SUPPORTED_METHODS:
        raise ValueError(f"quantization_config method {method!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_METHODS)}")
    if method == "gguf":  # how transformers marks a config it read from a GGUF file
        return QuantSpec("gguf")
    if method == "fp8":
        return _fp8_spec(config)
    if method == "mxfp4":  # GPT-OSS's experts (the rest 16-bit): dequantized at load
        return QuantSpec("mxfp4", 4, 32, dequantize=True)
    if method == "compressed-tensors":
        return _compressed_tensors_spec(config)
    bits = _get(config, "bits", _get(config, "w_bit"))
    group = _get(config, "group_size", _get(config, "q_group_size"))
    skipped = _get(config, "modules_to_not_convert") or []
    if [name for name in skipped if name != "lm_head"]:
        raise ValueError(f"quantization_config ({method}) modules_to_not_convert={skipped!r} "
                         "is not supported: every linear of the decoder must be quantized")
    if bits != 4:
        raise ValueError(f"quantization_config ({method}) bits={bits!r} is not supported; "
                         "supported: 4")
    if group not in INT4_GROUP_SIZES:
        raise ValueError(f"quantization_config ({method}) group_size={group!r} is not "
                         f"supported; supported: {', '.join(map(str, INT4_GROUP_SIZES))}")
    if method == "awq":
        version = str(_get(config, "version", "gemm")).lower()
        if version != "gemm" or _get(config, "zero_point", True) is not True:
            raise ValueError(f"quantization_config (awq) version={version!r}, zero_point="
                             f"{_get(config, 'zero_point', True)!r} is not supported; "
                             "supported: version 'gemm' with zero_point=True")
        return QuantSpec("awq", 4, group)
    fmt = str(_get(config, "checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config (gptq) checkpoint_format={fmt!r} is not "
                         "supported; supported: gptq, gptq_v2")
    return QuantSpec("gptq", 4, group, bool(_get(config, "desc_act", False)),
                     zero_offset=1 if fmt == "gptq" else 0)


def _fp8_spec(config: Any) -> QuantSpec:
    """The fp8 method of Qwen3-*-FP8 and DeepSeek checkpoints: e4m3 weights, a scale a block
    (``weight_scale_inv``) or a tensor (``weight_scale``), dynamic activation scales."""
    scheme = _get(config, "activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"quantization_config (fp8) activation_scheme={scheme!r} is not "
                         "supported; supported: dynamic")
    block = _get(config, "weight_block_size")
    if block is None:
        return QuantSpec("fp8", 8, fp8_scales="tensor")
    if len(block) != 2 or any(int(b) % 16 for b in block):
        raise ValueError(f"quantization_config (fp8) weight_block_size={block!r} is not "
                         "supported; supported: two multiples of 16, e.g. [128, 128]")
    return QuantSpec("fp8", 8, fp8_scales="block", weight_block=(int(block[0]), int(block[1])))


def _compressed_tensors_spec(config: Any) -> QuantSpec:
    """compressed-tensors' FP8 W8A8: one group of Linear targets, float 8-bit weights with a
    scale a tensor or a channel, dynamic per-token activation scales (or none)."""
    groups = _get(config, "config_groups") or {}
    ignore = [name for name in (_get(config, "ignore") or []) if name != "lm_head"]
    problem = None
    if len(groups) != 1 or ignore:
        problem = f"{len(groups)} config groups, ignore={ignore}"
    else:
        group = next(iter(groups.values()))
        weights, acts = _get(group, "weights") or {}, _get(group, "input_activations")
        if (_get(weights, "num_bits"), _get(weights, "type")) != (8, "float") or _get(
                weights, "strategy") not in ("tensor", "channel"):
            problem = f"weights {weights}"
        elif acts is not None and not (_get(acts, "dynamic") is True
                                       and _get(acts, "strategy") == "token"):
            problem = f"input_activations {acts}"
    if problem is not None:
        raise ValueError(f"quantization_config (compressed-tensors) with {problem} is not "
                         "supported; supported: one group of 8-bit float weights (strategy "
                         "tensor or channel) with dynamic per-token activations, ignoring at "
                         "most lm_head")
    return QuantSpec("compressed-tensors", 8, fp8_scales=_get(weights, "strategy"))


def resolve_quant_spec(quantization_config: Any, is_gguf: bool, option: str) -> QuantSpec | None:
    """The quantization a model loads with under ``EngineConfig.quantization`` ``option``."""
    if option not in QUANTIZATION_OPTIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_OPTIONS)}, "
                         f"got {option!r}")
    if option == "fp8":
        if is_gguf or quantization_config:
            raise ValueError("quantization='fp8' quantizes a 16- or 32-bit checkpoint at load; "
                             "this one is already quantized")
        return QuantSpec("fp8", 8, fp8_scales="online")
    if is_gguf:
        spec = QuantSpec("gguf")
    elif quantization_config:
        spec = parse_quantization_config(quantization_config)
        if spec.method == "gguf":  # a folder transformers saved from a GGUF: float weights
            return None
    else:
        return None
    return QuantSpec(**{**spec.__dict__, "dequantize": option == "none"})
