"""DeepSeek-V2's mixture of experts: its router (softmax, group-limited top-k, scaled weights)
and the MoE MLP with always-on shared experts beside the routed ones (layers/moe.py's)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.hf_deepseek import ExpertRouting
from nanoserve.layers.moe import Experts, add_experts
from nanoserve.layers.norm import RMSNorm
from nanoserve.layers.parallel_state import get_tp_group


class GroupedRouter(nn.Module):
    """Scores every expert by a float32 softmax of float32 logits (a float32 weight, as
    transformers keeps it); with groups, zeroes the experts outside the ``topk_group`` groups
    whose best expert scores highest; weights the top k by their scores times ``scaling``."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, routing: ExpertRouting):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
        self.top_k, self.routing = top_k, routing
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight.float())
        if x.is_cuda:  # softmax, groups, top k and scaling in one launch
            from nanoserve.kernels.moe_route import route_top_k
            return route_top_k(scores, self.top_k, False, self.routing.n_group,
                               self.routing.topk_group, self.routing.scaling, dtype=x.dtype)
        scores = scores.softmax(dim=-1)
        groups, keep = self.routing.n_group, self.routing.topk_group
        if keep < groups:
            by_group = scores.view(-1, groups, scores.shape[-1] // groups)
            best = torch.topk(by_group.amax(dim=-1), keep, dim=-1, sorted=False).indices
            chosen = torch.zeros(by_group.shape[:2], dtype=torch.bool, device=x.device)
            chosen.scatter_(1, best, True)
            scores = by_group.masked_fill(~chosen[..., None], 0.0).view_as(scores)
        weights, experts = torch.topk(scores, self.top_k, dim=-1, sorted=False)
        return (weights * self.routing.scaling).to(x.dtype), experts


class SharedExpertsMoeBlock(nn.Module):
    """The MLP of a DeepSeek MoE layer: routed experts plus ``shared_experts`` (a dense gated
    MLP every token passes through), both reading the one normalised input."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 routing: ExpertRouting, shared_experts: nn.Module | None):
        super().__init__()
        self.tp = get_tp_group()
        self.gate = GroupedRouter(hidden_size, num_experts, top_k, routing)
        self.experts = Experts(num_experts, hidden_size, intermediate_size)
        self.shared_experts = shared_experts

    def forward(self, residual: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """``residual`` plus the routed experts' mix and the shared experts of
        ``norm(residual)``."""
        normed = norm(residual)
        out = add_experts(self.tp, self.experts, normed, self.gate(normed), residual)
        return out if self.shared_experts is None else self.shared_experts.add_to(out, normed)
