"""Mixture-of-experts MLP (Qwen3-MoE): a replicated router weights each token's top-k SiLU-gated
experts, split across ranks as the dense MLP is; on CUDA the routing stays on the device."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.layers.activation import silu_and_mul
from nanoserve.layers.linear import linear
from nanoserve.layers.norm import RMSNorm
from nanoserve.layers.parallel_state import Narrow, divide, get_tp_group

# One expert's checkpoint tensor: (index, "gate" | "up" | "down"); None: all experts in one.
ExpertShard = tuple[int, str] | None


def experts_loop(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                 weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """``sum_j weights[:, j] * expert_{experts[:, j]}(x)`` (``gate_up`` ``[E, 2I, H]``,
    ``down`` ``[E, H, I]``), one expert at a time: the CPU path and the GPU kernels' reference."""
    out = torch.zeros_like(x)
    # Ascending expert order, each adding into its tokens' rows: transformers' order.
    for e in torch.unique(experts).tolist():
        tokens, slots = torch.where(experts == e)
        h = silu_and_mul(F.linear(x[tokens], gate_up[e]))
        h = F.linear(h, down[e]) * weights[tokens, slots, None]
        out.index_add_(0, tokens, h)
    return out


class Router(nn.Module):
    """Top-k routing: softmax over the experts in float32, the k largest, optionally
    renormalised to sum to one, returned in the input's dtype with the experts' indices."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalise: bool):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
        self.top_k = top_k
        self.renormalise = renormalise
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(x, self.weight, None)  # batch 1 on CUDA: the skinny GEMV
        if x.is_cuda:
            from nanoserve.kernels.fused_moe import route_top_k
            return route_top_k(logits, self.top_k, self.renormalise)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts


class Experts(nn.Module):
    """Every expert's weights stacked: ``gate_up_proj`` ``[E, 2 * I / tp, H]`` ([gate | up] of
    this rank's intermediate features) and ``down_proj`` ``[E, H, I / tp]``."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.tp = get_tp_group()
        self.full = intermediate_size
        self.per_rank = divide(intermediate_size, self.tp.size, "moe_intermediate_size")
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * self.per_rank,
                                                     hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, self.per_rank),
                                      requires_grad=False)

    def checkpoint_slice(self, param: nn.Parameter, shard_id: ExpertShard = None
                         ) -> Narrow | None:
        start = self.tp.rank * self.per_rank
        if shard_id is None:  # fused: gate and up rows are apart, so gate/up is read whole
            return None if param is self.gate_up_proj else Narrow(2, start, self.per_rank)
        return Narrow(1 if shard_id[1] == "down" else 0, start, self.per_rank)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: ExpertShard = None) -> None:
        if shard_id is None:
            if param is self.gate_up_proj:
                mine = slice(self.tp.rank * self.per_rank, (self.tp.rank + 1) * self.per_rank)
                gate, up = loaded[:, :self.full], loaded[:, self.full:]
                loaded = torch.cat([gate[:, mine], up[:, mine]], dim=1)
            param.data.copy_(loaded)
            return
        expert, part = shard_id
        if expert >= param.shape[0]:
            raise ValueError(f"checkpoint has expert {expert}; the config has {param.shape[0]}")
        rows = {"gate": slice(0, self.per_rank), "up": slice(self.per_rank, None)}.get(
            part, slice(None))  # down: the expert's whole matrix
        param.data[expert, rows].copy_(loaded)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
                ) -> torch.Tensor:
        """This rank's share of ``sum_j weights[:, j] * expert_{experts[:, j]}(x)``."""
        if x.is_cuda:
            from nanoserve.kernels.fused_moe import fused_experts
            return fused_experts(x, self.gate_up_proj, self.down_proj, weights, experts)
        return experts_loop(x, self.gate_up_proj, self.down_proj, weights, experts)


class SparseMoeBlock(nn.Module):
    """The MLP of a mixture-of-experts layer, taking its pre-norm as the dense MLP does."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalise: bool):
        super().__init__()
        self.tp = get_tp_group()
        self.gate = Router(hidden_size, num_experts, top_k, renormalise)
        self.experts = Experts(num_experts, hidden_size, intermediate_size)

    def forward(self, residual: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """``residual`` plus the experts' mix of ``norm(residual)``."""
        normed = norm(residual)
        return residual + self.tp.all_reduce(self.experts(normed, *self.gate(normed)))
