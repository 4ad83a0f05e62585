"""The router kernel against PyTorch's softmax and top-k (and DeepSeek's group-limited
choice), on the CPU interpreter, with logits far enough apart that the top k are unique."""
import os

# Must precede any triton import: the kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nanoserve.hf_deepseek import ExpertRouting  # noqa: E402
from nanoserve.kernels.moe_route import route_top_k  # noqa: E402
from nanoserve.layers.moe_router import GroupedRouter  # noqa: E402


def distinct_logits(num_tokens: int, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """Logits 0.05 apart in a random order per token: no ties in 16 bits, so top-k is unique."""
    ranks = torch.stack([torch.randperm(num_experts, generator=gen) for _ in range(num_tokens)])
    return 0.05 * ranks - 2.0


@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (60, 4), (128, 8), (6, 6), (5, 1)])
@pytest.mark.parametrize("renormalise", [True, False])
def test_route_top_k_matches_softmax_topk(num_experts, top_k, renormalise):
    gen = torch.Generator().manual_seed(num_experts * 10 + top_k)
    logits = distinct_logits(23, num_experts, gen).half()
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    expected_weights, expected_experts = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        expected_weights = expected_weights / expected_weights.sum(-1, keepdim=True)
    weights, experts = route_top_k(logits, top_k, renormalise)
    assert weights.dtype == torch.float16 and experts.dtype == torch.int32
    assert torch.equal(experts.long(), expected_experts)
    torch.testing.assert_close(weights, expected_weights.half(), atol=1e-3, rtol=1e-3)


def test_route_top_k_rejects_bad_k():
    with pytest.raises(ValueError, match="top_k"):
        route_top_k(torch.randn(2, 4), 5, True)


@pytest.mark.parametrize("num_tokens,num_experts,top_k,groups,keep", [
    (5, 8, 2, 1, 1),     # greedy: no groups
    (23, 16, 3, 4, 2),   # group-limited
    (9, 20, 4, 4, 1),    # groups of 5 experts, not a power of two
    (3, 64, 6, 8, 3),    # DeepSeek-V2's routing on fewer experts
])
def test_grouped_routing_matches_the_routers_pytorch_path(num_tokens, num_experts, top_k,
                                                          groups, keep):
    """The kernel's group-limited, scaled choice against ``GroupedRouter``'s PyTorch path,
    whose identity weight makes the logits the rows themselves."""
    gen = torch.Generator().manual_seed(num_tokens + num_experts)
    router = GroupedRouter(num_experts, num_experts, top_k,
                           ExpertRouting(n_group=groups, topk_group=keep, scaling=1.5))
    router.weight.copy_(torch.eye(num_experts))
    logits = distinct_logits(num_tokens, num_experts, gen)
    want_weights, want_experts = router(logits)
    weights, experts = route_top_k(logits, top_k, False, groups, keep, 1.5,
                                   dtype=torch.float16)
    assert experts.dtype == torch.int32 and weights.dtype == torch.float16
    order, want_order = experts.long().sort(-1), want_experts.sort(-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices),
                               want_weights.gather(1, want_order.indices).half())


def test_route_top_k_rejects_groups_that_do_not_divide():
    with pytest.raises(ValueError, match="groups"):
        route_top_k(torch.randn(2, 6), 2, False, n_group=4)
