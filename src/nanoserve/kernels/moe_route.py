"""Routers on the GPU: each token's choice of experts from its router logits in one launch
(graph-capturable, no host sync), as softmax then top-k give it: maybe renormalised (Qwen3-MoE,
Mixtral), maybe limited to the best groups of experts and scaled (DeepSeek-V2)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanoserve.kernels.common import interpreted, programmatic_launch


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, experts_ptr, num_experts, stride_lt, scaling,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    RENORMALISE: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    GROUP_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, PDL: tl.constexpr,
):
    """One token: float32 softmax over its experts; with TOPK_GROUP < N_GROUP only the experts
    of the TOPK_GROUP groups whose best score is highest compete (the others score 0); the
    TOP_K largest first, maybe renormalised, times ``scaling``."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + token * stride_lt + e, mask=e < num_experts,
                     other=float("-inf")).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, 0))
    probs = probs / tl.sum(probs, 0)
    if TOPK_GROUP < N_GROUP:
        group_of = e // GROUP_SIZE
        g = tl.arange(0, BLOCK_G)
        best = tl.full([BLOCK_G], -1.0, dtype=tl.float32)  # groups past N_GROUP: never chosen
        for group in tl.static_range(N_GROUP):
            best = tl.where(g == group, tl.max(tl.where(group_of == group, probs, -1.0), 0), best)
        keep = e < 0
        for _ in tl.static_range(TOPK_GROUP):
            chosen = tl.argmax(best, 0)
            keep = keep | (group_of == chosen)
            best = tl.where(g == chosen, -2.0, best)
        probs = tl.where(keep, probs, 0.0)
        probs = tl.where(e < num_experts, probs, -1.0)  # padding: below every masked expert
    slot = tl.arange(0, BLOCK_K)
    top_weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_experts = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(probs, 0)  # the lowest index among ties
        top_weights = tl.where(slot == j, tl.max(probs, 0), top_weights)
        top_experts = tl.where(slot == j, best, top_experts)
        probs = tl.where(e == best, -1.0, probs)
    if RENORMALISE:
        top_weights = top_weights / tl.sum(top_weights, 0)
    tl.store(weights_ptr + token * TOP_K + slot,
             (top_weights * scaling).to(weights_ptr.dtype.element_ty), mask=slot < TOP_K)
    tl.store(experts_ptr + token * TOP_K + slot, top_experts, mask=slot < TOP_K)


def route_top_k(logits: torch.Tensor, top_k: int, renormalise: bool, n_group: int = 1,
                topk_group: int = 1, scaling: float = 1.0,
                dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice from its ``[T, E]`` logits in one launch, as ``softmax`` + ``topk``
    (+ renormalising) give it; with ``topk_group`` < ``n_group``, DeepSeek's group-limited
    choice. Returns ``[T, top_k]`` weights (times ``scaling``, in ``dtype``, default the
    logits') and int32 experts."""
    num_tokens, num_experts = logits.shape
    if not 0 < top_k <= num_experts or logits.stride(-1) != 1 or num_experts % n_group:
        raise ValueError(f"route_top_k needs 0 < top_k <= {num_experts} experts in groups of "
                         f"equal size and logits with contiguous rows; got top_k {top_k}, "
                         f"{n_group} groups")
    weights = torch.empty((num_tokens, top_k), dtype=dtype or logits.dtype,
                          device=logits.device)
    experts = torch.empty((num_tokens, top_k), dtype=torch.int32, device=logits.device)
    pdl = programmatic_launch(logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](
            logits, weights, experts, num_experts, logits.stride(0), scaling,
            TOP_K=top_k, BLOCK_E=triton.next_power_of_2(num_experts),
            BLOCK_K=triton.next_power_of_2(top_k), RENORMALISE=renormalise,
            N_GROUP=n_group, TOPK_GROUP=topk_group, GROUP_SIZE=num_experts // n_group,
            BLOCK_G=triton.next_power_of_2(n_group), PDL=pdl,
            num_warps=1 if interpreted(logits.device) else 4, launch_pdl=pdl,
        )
    return weights, experts
