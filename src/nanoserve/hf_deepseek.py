"""DeepSeek-V2's config fields: multi-head latent attention's ranks and widths, the softmax
scale YaRN's ``mscale_all_dim`` sets, which layers hold experts, and the router (groups,
scaling, shared experts). Each is read into ``ModelConfig`` or refused with the field named,
as transformers' ``DeepseekV2`` reads it. No torch."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

DEEPSEEK_V2 = "DeepseekV2ForCausalLM"
TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass(frozen=True)
class MlaDims:
    """Multi-head latent attention's widths: q through a rank-``q_lora_rank`` bottleneck (0: a
    plain q_proj); keys and values decompressed from a ``kv_lora_rank`` latent shared by all
    heads; RoPE on each head's last ``qk_rope_head_dim`` query features and on one key part
    of that width, also shared. The cache holds the latent and that key part only."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """What one token keeps per layer: its latent, then its rotated key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ExpertRouting:
    """DeepSeek's router: a float32 softmax over the experts; with ``topk_group`` < ``n_group``
    (group_limited_greedy) only the experts of the ``topk_group`` groups holding the best
    single scores compete; the top k, each weight times ``scaling``. ``num_shared`` always-on
    experts sit beside them as one dense MLP."""

    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0
    num_shared: int = 0


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def deepseek_fields(hf_config: Any, scaling: dict[str, Any] | None) -> dict[str, Any]:
    """The ModelConfig fields DeepSeek-V2 sets (``scaling``: its parsed RoPE scaling)."""
    def field(name: str, default: Any = None) -> Any:
        value = getattr(hf_config, name, None)
        return default if value is None else value

    heads, kv_heads = hf_config.num_attention_heads, field("num_key_value_heads")
    if kv_heads not in (None, heads):
        raise ValueError(f"num_key_value_heads={kv_heads} is not supported for {DEEPSEEK_V2}: "
                         f"every one of the {heads} heads decompresses the one latent")
    method = field("topk_method", "greedy")
    if method not in TOPK_METHODS:
        raise ValueError(f"topk_method={method!r} is not supported; supported: "
                         f"{', '.join(TOPK_METHODS)}")
    if field("scoring_func", "softmax") != "softmax":
        raise ValueError(f"scoring_func={field('scoring_func')!r} is not supported: the router "
                         "scores by softmax")
    # transformers' router never renormalises; DeepSeek's own code does: two different models.
    if field("norm_topk_prob", False):
        raise ValueError(f"norm_topk_prob=True is not supported for {DEEPSEEK_V2}")
    if field("ep_size", 1) != 1:
        raise ValueError(f"ep_size={field('ep_size')} is not supported: experts split by "
                         "tensor parallelism only")
    experts = int(field("n_routed_experts", 0))
    groups, top_groups = int(field("n_group", 1)), int(field("topk_group", 1))
    if method == "greedy":  # transformers reads the groups only for group_limited_greedy
        groups = top_groups = 1
    if groups < 1 or experts % groups or not 1 <= top_groups <= groups:
        raise ValueError(f"n_group={groups}, topk_group={top_groups} do not group "
                         f"n_routed_experts={experts}")
    first_dense, freq = int(field("first_k_dense_replace", 0)), int(field("moe_layer_freq", 1))
    if freq < 1:
        raise ValueError(f"moe_layer_freq must be >= 1, got {freq}")
    moe_layers = tuple(i for i in range(hf_config.num_hidden_layers)
                       if experts and i >= first_dense and i % freq == 0)
    return dict(mla=_mla_dims(hf_config, scaling), moe_layers=moe_layers, norm_topk_prob=False,
                head_dim=int(hf_config.qk_rope_head_dim),
                routing=ExpertRouting(groups, top_groups, float(field("routed_scaling_factor",
                                                                      1.0)),
                                      int(field("n_shared_experts", 0))))


def _mla_dims(hf_config: Any, scaling: dict[str, Any] | None) -> MlaDims:
    nope, rope = int(hf_config.qk_nope_head_dim), int(hf_config.qk_rope_head_dim)
    if rope % 2:
        raise ValueError(f"qk_rope_head_dim must be even, got {rope}")
    scale = (nope + rope) ** -0.5
    # transformers' yarn_apply_mscale: any scaled RoPE with mscale_all_dim sharpens softmax.
    if scaling is not None and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return MlaDims(q_lora_rank=int(getattr(hf_config, "q_lora_rank", None) or 0),
                   kv_lora_rank=int(hf_config.kv_lora_rank), qk_nope_head_dim=nope,
                   qk_rope_head_dim=rope, v_head_dim=int(hf_config.v_head_dim),
                   softmax_scale=scale)
