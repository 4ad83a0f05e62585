"""The fused-MoE grouping and grouped GEMMs against a per-expert float64 loop, on the CPU
interpreter, with fresh random routing: experts with no tokens, with one, with many."""
import os

# Must precede any triton import: the kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nanoserve.kernels.fused_moe import (MoeTiles, fused_experts, group_by_expert,  # noqa: E402
                                         max_blocks)
from nanoserve.layers.moe import ExpertActivation, experts_loop  # noqa: E402


def random_routing(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k distinct experts per token, skewed so that some experts get most tokens and
    some none; weights from a softmax, as a router gives them."""
    scores = torch.rand(num_tokens, num_experts, generator=gen) \
        * torch.linspace(0.2, 3.0, num_experts)
    experts = torch.topk(scores, top_k, dim=-1).indices
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=-1)
    return weights.to(dtype), experts


def reference(x, gate_up, down, weights, experts):
    """The CPU path's per-expert loop, in float64."""
    return experts_loop(*(t.double() for t in (x, gate_up, down, weights)), experts)


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m",
                         [(1, 8, 2, 16), (5, 6, 3, 16), (37, 8, 2, 16), (40, 4, 1, 32),
                          (3, 64, 8, 16)])
def test_group_by_expert_covers_every_pair_once(num_tokens, num_experts, top_k, block_m):
    gen = torch.Generator().manual_seed(num_tokens * num_experts + top_k)
    _, experts = random_routing(num_tokens, num_experts, top_k, gen)
    blocks = group_by_expert(experts, num_experts, block_m)
    num_pairs = num_tokens * top_k
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    assert blocks.pair_ids.shape == (num_blocks * block_m,)
    assert blocks.block_expert.shape == (num_blocks,)
    rows = blocks.pair_ids.view(num_blocks, block_m)
    real = rows < num_pairs
    # Every pair in exactly one row, the rest padding.
    assert sorted(rows[real].tolist()) == list(range(num_pairs))
    flat = experts.reshape(-1)
    used = blocks.block_expert >= 0
    for block in range(num_blocks):
        pairs = rows[block][real[block]]
        if not used[block]:
            assert pairs.numel() == 0
            continue
        # A block holds only its expert's pairs, padding after them.
        assert pairs.numel() > 0
        assert (flat[pairs.long()] == blocks.block_expert[block]).all()
        assert real[block, :pairs.numel()].all()
    # Used blocks come first, experts in ascending order; each used expert's pairs fill
    # ceil(count / block_m) blocks.
    assert used.tolist() == sorted(used.tolist(), reverse=True)
    used_experts = blocks.block_expert[used]
    assert used_experts.tolist() == sorted(used_experts.tolist())
    counts = torch.bincount(flat, minlength=num_experts)
    for e in range(num_experts):
        assert (used_experts == e).sum().item() == -(-counts[e].item() // block_m)


@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter",
                         [(1, 8, 2, 32, 48), (5, 6, 3, 40, 24), (37, 8, 2, 64, 32),
                          (19, 4, 4, 32, 16)])
def test_fused_experts_matches_per_expert_loop(num_tokens, num_experts, top_k, hidden, inter):
    gen = torch.Generator().manual_seed(1000 + num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    weights, experts = random_routing(num_tokens, num_experts, top_k, gen)
    out = fused_experts(x, gate_up, down, weights, experts)
    expected = reference(x, gate_up, down, weights, experts)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


def test_fused_experts_in_16_bits_and_64_row_blocks_added_to_a_residual():
    gen = torch.Generator().manual_seed(7)
    num_tokens, num_experts, top_k, hidden, inter = 70, 4, 2, 32, 32
    x = torch.randn(num_tokens, hidden, generator=gen).half()
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).half()
    down = (torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5).half()
    weights, experts = random_routing(num_tokens, num_experts, top_k, gen, torch.float16)
    residual = torch.randn(num_tokens, hidden, generator=gen).half()
    tiles = MoeTiles(64, 16, 16, 1, 1)
    out = fused_experts(x, gate_up, down, weights, experts, gate_up_config=tiles,
                        down_config=tiles, residual=residual)
    expected = residual.double() + reference(x, gate_up, down, weights, experts)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), expected, atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("num_tokens,top_k", [(1, 4), (23, 2)])
def test_fused_experts_with_biases_and_clamped_swiglu(num_tokens, top_k):
    """GPT-OSS's experts: biases on both projections and the clamped SwiGLU, large enough
    inputs that the clamp bites, against the loop in float64."""
    gen = torch.Generator().manual_seed(31 + num_tokens)
    num_experts, hidden, inter = 8, 32, 16
    x = 4 * torch.randn(num_tokens, hidden, generator=gen)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    gate_up_bias = torch.randn(num_experts, 2 * inter, generator=gen)
    down_bias = torch.randn(num_experts, hidden, generator=gen)
    weights, experts = random_routing(num_tokens, num_experts, top_k, gen)
    act = ExpertActivation(alpha=1.702, limit=7.0)
    out = fused_experts(x, gate_up, down, weights, experts, activation=act,
                        gate_up_bias=gate_up_bias, down_bias=down_bias)
    expected = experts_loop(*(t.double() for t in (x, gate_up, down, weights)), experts, act,
                            gate_up_bias.double(), down_bias.double())
    clamped = (torch.cat([x @ gate_up[e].T for e in range(num_experts)]).abs() > 7).any()
    assert clamped
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


def test_fused_experts_rejects_mismatched_shapes():
    x = torch.randn(3, 32)
    gate_up, down = torch.randn(4, 48, 32), torch.randn(4, 32, 24)
    weights, experts = torch.ones(3, 2), torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="gate_up"):
        fused_experts(x, gate_up, torch.randn(4, 32, 20), weights, experts)
    with pytest.raises(ValueError, match="routing"):
        fused_experts(x, gate_up, down, weights[:2], experts[:2])
