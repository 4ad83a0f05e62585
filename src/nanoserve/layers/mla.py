"""DeepSeek-V2's multi-head latent attention: the layer's projections, its RoPE, and the call
into the backend, whose cache holds one ``[latent | k_rope]`` row per token and layer."""
from __future__ import annotations

import torch
from torch import nn

from nanoserve.attention.backend import AttentionBackend
from nanoserve.attention.cache_spec import CacheSpec
from nanoserve.attention.metadata import get_attention_metadata
from nanoserve.config import ModelConfig
from nanoserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from nanoserve.layers.norm import RMSNorm
from nanoserve.layers.parallel_state import divide, get_tp_group
from nanoserve.layers.replicated_linear import ReplicatedLinear
from nanoserve.layers.rotary import RotaryEmbedding

# transformers builds q_a_layernorm and kv_a_layernorm with its RMSNorm's default epsilon.
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """Multi-head latent attention: q from ``q_proj`` or the ``q_a_proj`` -> norm ->
    ``q_b_proj`` bottleneck; ``kv_a_proj_with_mqa`` gives each token's latent (normed by
    ``kv_a_layernorm``) and one RoPE key part shared by the heads; ``kv_b_proj`` holds each
    head's key and value up-projections of the latent, which the backend applies to the cached
    latents (prefill) or absorbs into q and the output (decode)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, index: int):
        super().__init__()
        if not hasattr(backend, "mla_attention"):
            raise ValueError(f"{cfg.architecture}'s multi-head latent attention has no kernels "
                             f"on the {type(backend).__name__}: run it with device='cpu'")
        dims = self.dims = cfg.mla
        self.num_heads = divide(cfg.num_heads, get_tp_group().size, "num_attention_heads")
        self.num_kv_heads = 1  # one latent row, read by every head
        self.head_dim = dims.cache_width
        q_out, hidden = cfg.num_heads * dims.qk_head_dim, cfg.hidden_size
        if dims.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, dims.q_lora_rank)
            self.q_a_layernorm = RMSNorm(dims.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(dims.q_lora_rank, q_out)
        else:
            self.q_proj = ColumnParallelLinear(hidden, q_out)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, dims.cache_width)
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(
            dims.kv_lora_rank, cfg.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim))
        self.o_proj = RowParallelLinear(cfg.num_heads * dims.v_head_dim, hidden)
        self.rotary = RotaryEmbedding(dims.qk_rope_head_dim, cfg.max_position_embeddings,
                                      *cfg.rope_of(index))
        self.backend = backend
        self.k_cache = self.v_cache = torch.empty(0)  # bound by the model runner

    @property
    def cache_spec(self) -> CacheSpec:
        """One row of ``kv_lora_rank + qk_rope_head_dim`` per token, on every rank."""
        return CacheSpec(1, self.dims.cache_width, separate_values=False)

    def _query(self, x: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        if self.dims.q_lora_rank:
            return self.q_b_proj(self.q_a_proj(x, norm=norm), norm=self.q_a_layernorm)
        return self.q_proj(x, norm=norm)

    def input_projections(self) -> list[ColumnParallelLinear]:
        """The projections that read the layer's pre-norm: a folded norm goes into both."""
        return [self.q_a_proj if self.dims.q_lora_rank else self.q_proj,
                self.kv_a_proj_with_mqa]

    def forward(self, positions: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
                post_norm: RMSNorm | None = None) -> torch.Tensor:
        """``residual + o_proj(attention(norm(residual)))``."""
        dims = self.dims
        # A folded norm is applied by each projection; otherwise once, for both.
        x, folded = (residual, norm) if norm.folded else (norm(residual), None)
        q = self._query(x, folded).view(-1, self.num_heads, dims.qk_head_dim)
        out = self.backend.mla_attention(q, self.kv_a_proj_with_mqa(x, norm=folded), positions,
                                         self.rotary.cos_sin, self.kv_a_layernorm, self.k_cache,
                                         get_attention_metadata(), self.kv_b_proj.weight,
                                         dims.v_head_dim, dims.softmax_scale)
        return self.o_proj(out.reshape(-1, self.num_heads * dims.v_head_dim),
                           residual=residual)
