"""One decoder-only transformer for Llama, Mistral and Qwen2 (q/k/v biases), Qwen3 (per-head q/k
norms), Qwen3-MoE and Mixtral (experts for some MLPs), Gemma 2/3 (sandwich (1 + w) norms, GeGLU,
soft caps), Phi-3 and GPT-OSS (sinks, biases, experts everywhere), DeepSeek-V2 (latent
attention, layers/mla.py; shared experts and grouped routing, layers/moe_router.py). Between layers flows the
residual stream: each pre-norm is applied by the next projection (``norm=``), each output
projection adds into it (``residual=``) or, with a post-norm, its normalised output is added.
Per-layer differences (windows, RoPE) come from ModelConfig; checkpoint names from weight_map."""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from nanoserve.attention.backend import AttentionBackend
from nanoserve.attention.cache_spec import CacheSpec
from nanoserve.attention.metadata import get_attention_metadata
from nanoserve.config import ModelConfig
from nanoserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanoserve.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                     RowParallelLinear)
from nanoserve.layers.activation import GATED_ACTIVATIONS
from nanoserve.layers.mla import MLAttention
from nanoserve.layers.moe import ExpertActivation, SparseMoeBlock
from nanoserve.layers.moe_router import SharedExpertsMoeBlock
from nanoserve.layers.parallel_state import Narrow
from nanoserve.layers.norm import OffsetRMSNorm, RMSNorm
from nanoserve.layers.rotary import RotaryEmbedding, share_rotaries
from nanoserve.models.weight_map import gpt_oss_experts, parts_of, split_fused, target_of

if TYPE_CHECKING:
    from nanoserve.models.loader import CheckpointTensor


def make_norm(cfg: ModelConfig, dim: int) -> RMSNorm:
    """The model's RMSNorm: Gemma's scales by (1 + w)."""
    return (OffsetRMSNorm if cfg.norm_plus_one else RMSNorm)(dim, cfg.rms_norm_eps)


def _add_post_normed(residual: torch.Tensor, out: torch.Tensor, post_norm: RMSNorm
                     ) -> torch.Tensor:
    return residual + post_norm(out)


class Attention(nn.Module):
    """Self-attention over the paged KV cache: qkv projection, (q/k norm), RoPE, store, attend."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, index: int):
        super().__init__()
        self.window = cfg.window_of(index)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads,
                                          cfg.num_kv_heads, bias=cfg.attention_bias)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size,
                                        bias=cfg.o_proj_bias)
        # GPT-OSS: a learnt logit per head, this rank's heads'.
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False) \
            if cfg.attention_sinks else None
        self.q_norm = make_norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                      *cfg.rope_of(index), rotary_dim=cfg.rotary_dim)
        self.backend = backend
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.softcap = cfg.attn_softcap
        self.k_cache = self.v_cache = torch.empty(0)  # bound by the model runner
        self.cache_group = 0  # whose block tables this layer reads (set by the model runner)

    @property
    def cache_spec(self) -> CacheSpec:
        """This rank's K and V heads, each token's in both tensors."""
        return CacheSpec(self.num_kv_heads, self.head_dim)

    def checkpoint_slice(self, param: nn.Parameter, shard_id: object = None) -> Narrow:
        """The sinks of this rank's heads (the one parameter held here, not in a layer)."""
        return Narrow(0, self.qkv_proj.tp.rank * self.num_heads, self.num_heads)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        param.data.copy_(loaded)

    def forward(self, positions: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
                post_norm: RMSNorm | None = None) -> torch.Tensor:
        """``residual + o_proj(attention(norm(residual)))``, ``post_norm`` on the o_proj."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(residual, norm=norm).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k, v = (t.view(-1, self.num_kv_heads, self.head_dim) for t in (k, v))
        meta = get_attention_metadata().group(self.cache_group)
        out = self.backend.attention(positions, q, k, v, self.k_cache, self.v_cache, meta,
                                     self.rotary, self.scale, self.q_norm, self.k_norm,
                                     window=self.window, softcap=self.softcap, sinks=self.sinks)
        if post_norm is not None:
            return _add_post_normed(residual, self.o_proj(out.reshape(-1, q_size)), post_norm)
        return self.o_proj(out.reshape(-1, q_size), residual=residual)


class MLP(nn.Module):
    """Gated feed-forward (SiLU, or GELU for GeGLU): merged gate/up (column parallel), then
    down (row parallel)."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        width = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [width] * 2)
        self.down_proj = RowParallelLinear(width, cfg.hidden_size)
        self.act = GATED_ACTIVATIONS[cfg.hidden_act]  # None: SiLU, fused into the projection

    def add_to(self, out: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """``out + mlp(normed)``, the input already normalised (DeepSeek's shared experts)."""
        if self.act is None:
            return self.down_proj(self.gate_up_proj(normed, activate=True), residual=out)
        return self.down_proj(self.act(self.gate_up_proj(normed)), residual=out)

    def forward(self, residual: torch.Tensor, norm: RMSNorm,
                post_norm: RMSNorm | None = None) -> torch.Tensor:
        """``residual + mlp(norm(residual))``, ``post_norm`` on the MLP's output."""
        if self.act is None:
            act = self.gate_up_proj(residual, norm=norm, activate=True)
        else:
            act = self.act(self.gate_up_proj(residual, norm=norm))
        if post_norm is not None:
            return _add_post_normed(residual, self.down_proj(act), post_norm)
        return self.down_proj(act, residual=residual)


def _moe_block(cfg: ModelConfig) -> nn.Module:
    """A mixture-of-experts MLP: DeepSeek's (grouped router, shared experts) or the others'."""
    if cfg.routing is not None:
        shared = cfg.routing.num_shared
        return SharedExpertsMoeBlock(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                                     cfg.moe_intermediate_size, cfg.routing,
                                     MLP(cfg, cfg.moe_intermediate_size * shared) if shared
                                     else None)
    return SparseMoeBlock(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                          cfg.moe_intermediate_size, cfg.norm_topk_prob, cfg.moe_bias,
                          cfg.moe_topk_first, ExpertActivation(cfg.swiglu_alpha,
                                                               cfg.swiglu_limit))


class DecoderLayer(nn.Module):
    """Attention then MLP, each behind a pre-norm; with ``sandwich_norms`` (Gemma) each also
    has a post-norm, ``post_attention_layernorm`` then being attention's post-norm."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, index: int):
        super().__init__()
        self.self_attn = (MLAttention if cfg.mla else Attention)(cfg, backend, index)
        if index in cfg.moe_layers and GATED_ACTIVATIONS[cfg.hidden_act] is not None:
            raise ValueError(f"hidden_act={cfg.hidden_act!r} is not supported in experts")
        self.mlp = _moe_block(cfg) if index in cfg.moe_layers else MLP(cfg)
        self.input_layernorm = make_norm(cfg, cfg.hidden_size)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size)
        self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = make_norm(cfg, cfg.hidden_size)
            self.post_feedforward_layernorm = make_norm(cfg, cfg.hidden_size)

    @property
    def mlp_norm(self) -> RMSNorm:
        """The MLP's pre-norm."""
        return self.pre_feedforward_layernorm or self.post_attention_layernorm

    def forward(self, positions: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.pre_feedforward_layernorm is None:
            residual = self.self_attn(positions, residual, self.input_layernorm)
            return self.mlp(residual, self.post_attention_layernorm)
        residual = self.self_attn(positions, residual, self.input_layernorm,
                                  self.post_attention_layernorm)
        return self.mlp(residual, self.pre_feedforward_layernorm, self.post_feedforward_layernorm)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = cfg.embed_scale
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, i)
                                    for i in range(cfg.num_layers))
        self.norm = make_norm(cfg, cfg.hidden_size)
        share_rotaries([layer.self_attn for layer in self.layers])

    def forward(self, ids: torch.Tensor, positions: torch.Tensor,
                token_table: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states of ``ids``, or of ``token_table[ids]`` (the decode graphs' arena)."""
        if token_table is not None:
            ids = token_table[ids]
        residual = self.embed_tokens(ids)
        if self.embed_scale != 1.0:  # the scale rounded to the stream's dtype, as transformers'
            residual = residual * float(torch.tensor(self.embed_scale, dtype=residual.dtype))
        for layer in self.layers:
            residual = layer(positions, residual)
        return self.norm(residual)


class DecoderForCausalLM(nn.Module):
    """Token ids -> hidden states -> logits, with a loader for Hugging Face parameter names."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, backend)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, ids: torch.Tensor, positions: torch.Tensor,
                token_table: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(ids, positions, token_table)

    def fold_norm_weights(self) -> None:
        """Fold each layer's pre-norm weights into the projections reading it: qkv (MLA: q and
        the latent's) and a dense MLP's gate/up (GPU path; a router reads the normalised row,
        the LM head may share the embedding's weights; a post-norm reads no projection's
        input, and Gemma's hold 1 + w already)."""
        for layer in self.model.layers:
            attn = layer.self_attn
            if isinstance(attn, Attention):
                attn.qkv_proj.fold_norm(layer.input_layernorm)
            else:  # MLA: two projections read the pre-norm; q_b_proj its bottleneck's
                first, *others = attn.input_projections()
                first.fold_norm(layer.input_layernorm, *others)
                if attn.dims.q_lora_rank:
                    attn.q_b_proj.fold_norm(attn.q_a_layernorm)
            if isinstance(layer.mlp, MLP):
                layer.mlp.gate_up_proj.fold_norm(layer.mlp_norm)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None
                       ) -> torch.Tensor | None:
        """Logits of ``hidden``'s rows (None on ranks but 0); ``out``: see ParallelLMHead.
        With ``final_softcap`` (Gemma 2) they are ``cap * tanh(logits / cap)``."""
        logits = self.lm_head(hidden, out)
        cap = self.config.final_softcap
        if cap and logits is not None:  # in place: ``out`` stays the logits' buffer
            logits.div_(cap).tanh_().mul_(cap)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Load checkpoint tensors; a sharded parameter reads only its rank's slice of each."""
        params = dict(self.named_parameters(remove_duplicate=False))
        missing = {(n, slot) for n, p in self.named_parameters() for slot in parts_of(n, p)}
        if self.config.architecture == "GptOssForCausalLM":
            weights = gpt_oss_experts(weights)
        for name, tensor in split_fused(weights, self.config):
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight"
                                                 and self.config.tie_word_embeddings):
                continue
            # A parameter's own name (DeepSeek's q_proj) is no part of a packed one.
            target, shard = (name, None) if name in params else target_of(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                 f"{self.config.architecture}")
            param = params[target]
            owner = self.get_submodule(target.rsplit(".", 1)[0])
            if hasattr(owner, "weight_loader"):
                part = tensor.read(owner.checkpoint_slice(param, shard))
                owner.weight_loader(param, part.to(param.dtype), shard)
                if param is self.lm_head.weight and self.lm_head.reads_blocks:
                    self.lm_head.load_blocks(tensor.read(self.lm_head.blocks_slice()))
            else:  # replicated on every rank (norms, Qwen3's per-head q/k norms)
                param.data.copy_(tensor.read())
            if shard is None:  # a whole parameter, e.g. every expert in one fused tensor
                missing -= {m for m in missing if m[0] == target}
            missing.discard((target, shard))
        if missing:
            names = sorted(f"{n} ({slot})" if slot is not None else n for n, slot in missing)
            raise ValueError(f"checkpoint lacks tensors for: {names[:8]}")
