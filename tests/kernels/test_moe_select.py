"""Fused MoE's launch choice per grouped GEMM (tuning table, else the heuristic) and the
experts under tiles other than the default, on the CPU interpreter."""
import os

# Must precede any triton import: the kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nanoserve.kernels import fused_moe  # noqa: E402
from nanoserve.kernels.fused_moe import (MoeTiles, candidates, from_table,  # noqa: E402
                                         fused_experts, heuristic_config)
from nanoserve.layers.moe import experts_loop  # noqa: E402

SHAPE = "E=128,N=1536,K=2048"  # Qwen3-30B-A3B's gate_up GEMM


def test_untuned_shapes_launch_as_before_tables():
    """Without an entry: the tiles the GEMMs had before tuning tables, by pairs an expert."""
    for pairs, tiles in [(8, MoeTiles(16, 64, 128, 4, 4)), (512, MoeTiles(16, 64, 128, 4, 4)),
                         (2048, MoeTiles(32, 64, 128, 4, 4)), (8192, MoeTiles(64, 128, 64, 8, 3)),
                         (8193, MoeTiles(128, 128, 64, 8, 3))]:
        assert heuristic_config(pairs, 128) == from_table({}, pairs, 128, 1536, 2048) == tiles
    assert fused_moe.select(8, 128, 1536, 2048, torch.device("cpu")) \
        == fused_moe.INTERPRETER_TILES


def test_an_entry_applies_to_its_shape_and_pair_bucket_only():
    entry = MoeTiles(64, 64, 64, 4, 3)
    table = {SHAPE: {"64": entry._asdict()}}
    assert from_table(table, 64, 128, 1536, 2048) == entry
    assert from_table(table, 33, 128, 1536, 2048) == entry  # 33 to 64 pairs share the bucket
    assert from_table(table, 65, 128, 1536, 2048) == heuristic_config(65, 128)
    assert from_table(table, 64, 128, 2048, 768) == heuristic_config(64, 128)  # down's shape
    assert from_table({SHAPE: {"64": {"num_stages": 5}}}, 64, 128, 1536, 2048) \
        == heuristic_config(64, 128)._replace(num_stages=5)  # partial: the rest heuristic's
    with pytest.raises(ValueError, match="group_m"):
        from_table({SHAPE: {"64": {"group_m": 8}}}, 64, 128, 1536, 2048)


def test_each_gemm_selects_for_its_own_shape(monkeypatch):
    table = {SHAPE: {"16": {"block_n": 32}}, "E=128,N=2048,K=768": {"16": {"block_k": 32}}}
    monkeypatch.setattr(fused_moe, "load_table", lambda op, device: table)
    cuda = torch.device("cuda")  # only a key here: select reads the table patched in
    assert fused_moe.select(16, 128, 1536, 2048, cuda) == MoeTiles(16, 32, 128, 4, 4)
    assert fused_moe.select(16, 128, 2048, 768, cuda) == MoeTiles(16, 64, 32, 4, 4)


@pytest.mark.parametrize("pairs", [8, 2048, 65536])
def test_candidates_are_few_distinct_and_hold_the_heuristic(pairs):
    found = candidates(pairs, 128, 1536, 2048)
    assert 5 <= len(found) <= 20 and len(set(found)) == len(found)
    assert found[0] == heuristic_config(pairs, 128)
    assert all(16 <= c.block_m <= 128 for c in found)
    small = candidates(pairs, 8, 48, 32)  # beside the heuristic's, none past the weights
    assert all(c.block_n <= 64 and c.block_k <= 32 for c in small[1:])


@pytest.mark.parametrize("up,down", [
    (MoeTiles(16, 32, 16, 4, 2), MoeTiles(32, 16, 32, 4, 2)),  # regrouped for down's height
    (MoeTiles(32, 64, 32, 8, 3), MoeTiles(32, 32, 16, 4, 4)),
])
def test_fused_experts_match_per_expert_loop_under_candidates(up, down):
    gen = torch.Generator().manual_seed(5)
    num_tokens, num_experts, top_k, hidden, inter = 21, 6, 2, 32, 24
    x = torch.randn(num_tokens, hidden, generator=gen)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    down_w = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    # Skewed routing: some experts get many pairs, some none.
    scores = torch.rand(num_tokens, num_experts, generator=gen) \
        * torch.linspace(0.2, 3.0, num_experts)
    experts = torch.topk(scores, top_k, dim=-1).indices
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=-1)
    out = fused_experts(x, gate_up, down_w, weights, experts, gate_up_config=up,
                        down_config=down)
    expected = experts_loop(*(t.double() for t in (x, gate_up, down_w, weights)), experts)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)
