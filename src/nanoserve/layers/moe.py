"""Mixture-of-experts MLP (Qwen3-MoE, Mixtral, GPT-OSS): a replicated router weights each token's
top-k gated experts, split across ranks as the dense MLP is; on CUDA the routing stays on the
device. GPT-OSS's switches: router and expert biases, top-k before the softmax, a clamped SwiGLU."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.layers.activation import silu_and_mul
from nanoserve.layers.linear import linear
from nanoserve.layers.norm import RMSNorm
from nanoserve.layers.parallel_state import Narrow, TensorParallelGroup, divide, get_tp_group

# One expert's checkpoint tensor: (index, "gate" | "up" | "down"); None: all experts in one.
ExpertShard = tuple[int, str] | None


class ExpertActivation(NamedTuple):
    """The experts' gating over ``[gate | up]``: ``limit`` 0 is silu(gate) * up; otherwise
    GPT-OSS's ``(clamp(up, +-limit) + 1) * g * sigmoid(alpha * g)``, g = ``min(gate, limit)``."""

    alpha: float = 1.0
    limit: float = 0.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.limit:
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def experts_loop(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                 weights: torch.Tensor, experts: torch.Tensor,
                 act: ExpertActivation = ExpertActivation(),
                 gate_up_bias: torch.Tensor | None = None,
                 down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_j weights[:, j] * expert_{experts[:, j]}(x)`` (``gate_up`` ``[E, 2I, H]``,
    ``down`` ``[E, H, I]``, optional biases ``[E, 2I]`` and ``[E, H]``), one expert at a time:
    the CPU path and the GPU kernels' reference."""
    out = torch.zeros_like(x)
    # Ascending expert order, each adding into its tokens' rows: transformers' order.
    for e in torch.unique(experts).tolist():
        tokens, slots = torch.where(experts == e)
        h = F.linear(x[tokens], gate_up[e])
        h = act(h if gate_up_bias is None else h + gate_up_bias[e])
        h = F.linear(h, down[e])
        if down_bias is not None:
            h = h + down_bias[e]
        out.index_add_(0, tokens, h * weights[tokens, slots, None])
    return out


class Router(nn.Module):
    """Top-k routing: softmax over the experts in float32, the k largest, optionally
    renormalised to sum to one (``topk_first``: GPT-OSS's softmax over the k largest logits),
    returned in the input's dtype with the experts' indices."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalise: bool,
                 bias: bool = False, topk_first: bool = False):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
        self.top_k = top_k
        self.renormalise = renormalise
        self.topk_first = topk_first
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(x, self.weight, self.bias)  # batch 1 on CUDA: the skinny GEMV
        if self.topk_first:
            top, experts = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1, dtype=top.dtype).to(x.dtype), experts
        if x.is_cuda:
            from nanoserve.kernels.moe_route import route_top_k
            return route_top_k(logits, self.top_k, self.renormalise)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts


class Experts(nn.Module):
    """Every expert's weights stacked: ``gate_up_proj`` ``[E, 2 * I / tp, H]`` ([gate | up] of
    this rank's intermediate features) and ``down_proj`` ``[E, H, I / tp]``; with ``bias``,
    ``gate_up_proj_bias`` ``[E, 2 * I / tp]`` and ``down_proj_bias`` ``[E, H]`` (rank 0's)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 bias: bool = False, act: ExpertActivation = ExpertActivation()):
        super().__init__()
        self.tp = get_tp_group()
        self.full = intermediate_size
        self.per_rank = divide(intermediate_size, self.tp.size, "moe_intermediate_size")
        self.act = act
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * self.per_rank,
                                                     hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, self.per_rank),
                                      requires_grad=False)
        self.gate_up_proj_bias = self.down_proj_bias = None
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * self.per_rank),
                                                  requires_grad=False)
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size),
                                               requires_grad=False)

    def checkpoint_slice(self, param: nn.Parameter, shard_id: ExpertShard = None
                         ) -> Narrow | None:
        start = self.tp.rank * self.per_rank
        if shard_id is None:  # fused: gate and up rows are apart, so gate/up is read whole
            return Narrow(2, start, self.per_rank) if param is self.down_proj else None
        return Narrow(1 if shard_id[1] == "down" else 0, start, self.per_rank)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: ExpertShard = None) -> None:
        if shard_id is None:
            if param is self.gate_up_proj or param is self.gate_up_proj_bias:
                mine = slice(self.tp.rank * self.per_rank, (self.tp.rank + 1) * self.per_rank)
                gate, up = loaded[:, :self.full], loaded[:, self.full:]
                loaded = torch.cat([gate[:, mine], up[:, mine]], dim=1)
            elif param is self.down_proj_bias and self.tp.rank:
                loaded = torch.zeros_like(loaded)  # added once: by rank 0, before the reduce
            param.data.copy_(loaded)
            return
        expert, part = shard_id
        if expert >= param.shape[0]:
            raise ValueError(f"checkpoint has expert {expert}; the config has {param.shape[0]}")
        rows = {"gate": slice(0, self.per_rank), "up": slice(self.per_rank, None)}.get(
            part, slice(None))  # down: the expert's whole matrix
        param.data[expert, rows].copy_(loaded)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's share of ``sum_j weights[:, j] * expert_{experts[:, j]}(x)``, plus
        ``residual`` if given."""
        if x.is_cuda:
            from nanoserve.kernels.fused_moe import fused_experts
            return fused_experts(x, self.gate_up_proj, self.down_proj, weights, experts,
                                 activation=self.act,
                                 gate_up_bias=self.gate_up_proj_bias,
                                 down_bias=self.down_proj_bias, residual=residual)
        out = experts_loop(x, self.gate_up_proj, self.down_proj, weights, experts, self.act,
                           self.gate_up_proj_bias, self.down_proj_bias)
        return out if residual is None else residual + out


def add_experts(tp: TensorParallelGroup, experts: Experts, normed: torch.Tensor,
                routing: tuple[torch.Tensor, torch.Tensor],
                residual: torch.Tensor) -> torch.Tensor:
    """``residual`` plus the experts' mix of ``normed``: added inside the experts' last
    launch on one rank, after the reduction across several."""
    if tp.size == 1:
        return experts(normed, *routing, residual=residual)
    return residual + tp.all_reduce(experts(normed, *routing))


class SparseMoeBlock(nn.Module):
    """The MLP of a mixture-of-experts layer, taking its pre-norm as the dense MLP does."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalise: bool, bias: bool = False, topk_first: bool = False,
                 act: ExpertActivation = ExpertActivation()):
        super().__init__()
        self.tp = get_tp_group()
        self.gate = Router(hidden_size, num_experts, top_k, renormalise, bias, topk_first)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, bias, act)

    def forward(self, residual: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """``residual`` plus the experts' mix of ``norm(residual)``."""
        normed = norm(residual)
        return add_experts(self.tp, self.experts, normed, self.gate(normed), residual)
