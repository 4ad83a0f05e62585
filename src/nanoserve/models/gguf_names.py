"""What llama.cpp's converter writes, per GGUF architecture: its tensor names against Hugging
Face's, the tensors it changed on the way (llama's permuted q/k rows, Gemma's norms + 1,
Qwen3-MoE's stacked experts), and the config fields transformers' GGUF reader leaves at their
defaults although the file (or llama.cpp's fixed rule) says otherwise."""
from __future__ import annotations

from typing import Any

import torch

# GGUF names of the per-layer tensors ("blk.{i}.<suffix>") -> suffix under "model.layers.{i}.".
_ATTENTION = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
}
_QK_NORMS = {"attn_q_norm.weight": "self_attn.q_norm.weight",
             "attn_k_norm.weight": "self_attn.k_norm.weight"}
_MLP = {
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LLAMA = {**_ATTENTION, "ffn_norm.weight": "post_attention_layernorm.weight", **_MLP}
# Gemma's sandwich norms: ffn_norm is the norm before the MLP, not after attention.
_GEMMA2 = {**_ATTENTION, **_MLP,
           "post_attention_norm.weight": "post_attention_layernorm.weight",
           "ffn_norm.weight": "pre_feedforward_layernorm.weight",
           "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_QWEN3 = {**_LLAMA, **_QK_NORMS}

LAYER_NAMES: dict[str, dict[str, str]] = {
    # llama.cpp writes Mistral checkpoints as "llama" (there is no "mistral" GGUF architecture).
    "llama": _LLAMA,
    "qwen2": {**_LLAMA,
              "attn_q.bias": "self_attn.q_proj.bias",
              "attn_k.bias": "self_attn.k_proj.bias",
              "attn_v.bias": "self_attn.v_proj.bias"},
    "qwen3": _QWEN3,
    # The experts come stacked ([experts, rows, cols]): see EXPERT_NAMES.
    "qwen3moe": {**{k: v for k, v in _QWEN3.items() if k not in _MLP},
                 "ffn_gate_inp.weight": "mlp.gate.weight"},
    # Fused as in Hugging Face's Phi-3: q|k|v rows, and gate|up rows in ffn_up.
    "phi3": {**{k: v for k, v in _LLAMA.items()
                if k not in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight")},
             "attn_qkv.weight": "self_attn.qkv_proj.weight",
             "ffn_up.weight": "mlp.gate_up_proj.weight"},
    "gemma2": _GEMMA2,
    "gemma3": {**_GEMMA2, **_QK_NORMS},
}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Stacked experts of one layer -> the per-expert name ("mlp.experts.{j}.<part>.weight").
EXPERT_NAMES = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                "ffn_down_exps.weight": "down_proj"}
EXPERT_ARCHS = {"qwen3moe"}
# No Hugging Face parameter: transformers derives llama3's RoPE factors from the config.
SKIPPED_NAMES = {"rope_freqs.weight"}
# Tensors that would change the model in a way the config read from the file does not say.
REFUSED_NAMES = {
    "rope_factors_long.weight": "Phi-3 LongRoPE factors (transformers' GGUF config has no "
                                "rope_scaling for them)",
    "rope_factors_short.weight": "Phi-3 LongRoPE factors (transformers' GGUF config has no "
                                 "rope_scaling for them)",
}
# llama.cpp's converter interleaves the two rotary halves of q/k rows only for llama.
PERMUTED_ARCHS = {"llama"}
# Gemma's RMSNorm scales by (1 + w); llama.cpp's converter stores every "*norm.weight" as w + 1.
NORM_PLUS_ONE_ARCHS = {"gemma2", "gemma3"}


def norm_offset(arch: str, gguf_name: str) -> float:
    """What to subtract from a tensor to undo the converter (Gemma's norms + 1)."""
    return 1.0 if arch in NORM_PLUS_ONE_ARCHS and gguf_name.endswith("norm.weight") else 0.0


def fill_config(config: Any, arch: str, fields: dict[str, Any]) -> None:
    """Set what transformers' GGUF reader misses on ``config``: from the file's ``fields``, or
    as llama.cpp computes it where the file says nothing (it is the file's reference runtime)."""
    def field(key: str) -> Any:
        return fields.get(f"{arch}.{key}")

    # transformers maps key_length to head_dim for some architectures only (not qwen3, whose
    # config then defaults to 128); llama.cpp's head size is key_length wherever it is written.
    key_length, value_length = field("attention.key_length"), field("attention.value_length")
    if key_length is not None:
        if value_length is not None and int(value_length) != int(key_length):
            raise ValueError(f"{arch}: attention.value_length {value_length} != key_length "
                             f"{key_length} (nanoserve needs one head size)")
        config.head_dim = int(key_length)
    if arch == "qwen3moe" and field("expert_feed_forward_length") is not None:
        config.moe_intermediate_size = int(field("expert_feed_forward_length"))
    if arch in ("gemma2", "gemma3"):
        # llama.cpp scales queries by head_dim^-1/2, by (hidden / heads)^-1/2 for the 27B
        # models (gemma2: 46 layers, gemma3: 62), and never reads a scalar from the file.
        big = config.num_hidden_layers == {"gemma2": 46, "gemma3": 62}[arch]
        config.query_pre_attn_scalar = (config.hidden_size // config.num_attention_heads
                                        if big else config.head_dim)
    if arch == "phi3":  # Phi-4-mini rotates part of each head, and its window is in the file
        head_dim = config.hidden_size // config.num_attention_heads
        rotated = field("rope.dimension_count")
        if rotated is not None and int(rotated) != head_dim:
            config.partial_rotary_factor = int(rotated) / head_dim
        config.sliding_window = int(field("attention.sliding_window") or 0) or None
    rope = getattr(config, "rope_parameters", None)
    if arch == "gemma3" and field("rope.freq_base_swa") is not None and rope:
        rope.setdefault("sliding_attention", {"rope_type": "default"})["rope_theta"] = float(
            field("rope.freq_base_swa"))
    if arch == "gemma3":  # llama.cpp: no window, no sliding layers; else every 6th is full
        window = field("attention.sliding_window")
        period = field("attention.sliding_window_pattern")
        n = config.num_hidden_layers
        if not window:
            sliding = [False] * n
        elif isinstance(period, int):
            sliding = [i % period < period - 1 for i in range(n)]
        else:  # per layer, or absent
            sliding = [bool(s) for s in period] if period is not None else None
        if sliding is not None:
            config.layer_types = ["sliding_attention" if s else "full_attention" for s in sliding]
    # Caps the file leaves out stay at their defaults, as in llama.cpp.
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if arch in ("gemma2", "gemma3") and field(key) is not None:
            setattr(config, key, float(field(key)))


def _unpermute_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head (pair i, half j) back to (half j, pair i)."""
    head_dim = weight.shape[0] // n_heads
    return (weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


class GGUFTensor:
    """One GGUF tensor under its Hugging Face name, read when asked: dequantized, or as its
    blocks (``raw``: uint8 ``[rows, row bytes]``, float types as their values); llama's q/k
    rows already back in Hugging Face's order, Gemma's norms back from w + 1, and one expert
    (``expert``) of a stacked experts tensor read alone."""

    def __init__(self, tensor: Any, n_heads: int | None, expert: int | None = None,
                 offset: float = 0.0):
        self.type_name = tensor.tensor_type.name
        # GGUF lists dimensions fastest-first, the reverse of PyTorch's order.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        self.shape = shape if expert is None else shape[1:]
        self._tensor = tensor
        self._n_heads = n_heads
        self._expert = expert
        self._offset = offset

    def _data(self) -> Any:
        data = self._tensor.data
        return data if self._expert is None else data[self._expert]

    def _rows(self, array: Any) -> torch.Tensor:
        if not array.flags.writeable:  # a view of the read-only memory map
            array = array.copy()
        weight = torch.from_numpy(array)
        return weight if self._n_heads is None else _unpermute_rows(weight, self._n_heads)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        import gguf
        array = gguf.quants.dequantize(self._data(), self._tensor.tensor_type)
        weight = self._rows(array.reshape(self.shape))
        if self._offset:  # in float32, as transformers' loader does
            weight = weight.float() - self._offset
        return weight.to(dtype)

    def raw(self) -> torch.Tensor:
        if self._offset:
            raise ValueError(f"GGUF tensor {self._tensor.name!r} is read dequantized only")
        data = self._data()
        return self._rows(data.reshape(self.shape[0], -1) if len(self.shape) > 1 else data)
