"""o_proj merging split decode's partials, against float64 and the two-launch path, on the CPU
interpreter."""
import math
import os

# Must precede any triton import: the kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nanoserve.attention.backend import SplitPartials  # noqa: E402
from nanoserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from nanoserve.kernels.decode_attention import NewTokens, decode_attention  # noqa: E402
from nanoserve.kernels.merged_o_proj import MergedConfig, merged_o_proj  # noqa: E402
from nanoserve.kernels.skinny_gemm import skinny_linear  # noqa: E402
from nanoserve.layers.linear import RowParallelLinear  # noqa: E402
from nanoserve.layers.norm import AddedToResidual  # noqa: E402
from test_triton_attention import make_batch, new_token_inputs  # noqa: E402

TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=3e-3)}


def random_partials(heads: int, splits: int, head_dim: int, dtype: torch.dtype, seed: int,
                    empty: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Partials as the split kernel leaves them: empty splits have lse -inf and output 0."""
    gen = torch.Generator().manual_seed(seed)
    lse = 4 * torch.randn(1, heads, splits, generator=gen)
    out = torch.randn(1, heads, splits, head_dim, generator=gen)
    for head, split in empty:
        lse[0, head, split] = float("-inf")
        out[0, head, split] = 0
    return lse, out.to(dtype)


def merged_reference(lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The attention row ``[1, H * D]`` in float64: each head's splits weighted by the softmax
    of their lse, which are base-2 logarithms."""
    weight = torch.softmax(lse.double() * math.log(2), dim=-1).nan_to_num(0.0)  # no keys: zeros
    return (weight[..., None] * out.double()).sum(2).reshape(1, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,splits,head_dim,n", [(4, 3, 32, 40), (8, 8, 16, 13), (2, 1, 64, 8)])
@pytest.mark.parametrize("config", [None, MergedConfig(2, 1, 1), MergedConfig(8, 2, 2)],
                         ids=["default", "2x1", "8x2"])
def test_adds_the_merged_product_into_the_residual(dtype, heads, splits, head_dim, n, config):
    if config is not None and heads % config.heads_per_chunk:
        pytest.skip("the chunk does not divide the heads")
    lse, out = random_partials(heads, splits, head_dim, dtype, seed=heads + splits,
                               empty=[(0, splits - 1), (heads - 1, 0)])
    gen = torch.Generator().manual_seed(n)
    weight = torch.randn(n, heads * head_dim, generator=gen).div(head_dim ** 0.5).to(dtype)
    residual = torch.randn(1, n, generator=gen).to(dtype)
    # Attention's output is rounded to the model's dtype before o_proj, then the product is.
    attention = merged_reference(lse, out).to(dtype)
    expected = ((attention.double() @ weight.double().T).to(dtype).double()
                + residual.double()).to(dtype)
    sum_squares = torch.zeros(1, dtype=torch.float64)
    updated = merged_o_proj(lse, out, weight, residual, sum_squares, config)
    assert updated is residual
    torch.testing.assert_close(residual, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(sum_squares, residual.double().square().sum().reshape(1),
                               rtol=1e-6, atol=0)


def test_a_head_with_no_keys_contributes_nothing():
    lse, out = random_partials(2, 4, 16, torch.float32, seed=3, empty=[(1, s) for s in range(4)])
    weight = torch.randn(6, 32, generator=torch.Generator().manual_seed(4))
    residual = torch.zeros(1, 6)
    merged_o_proj(lse, out, weight, residual)
    torch.testing.assert_close(residual, (merged_reference(lse, out) @ weight.double().T).float())
    assert torch.isfinite(residual).all()


@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "norm+rope"])
def test_equals_split_decode_then_reduce_then_o_proj(qk_norm):
    """Split decode keeping its partials, then the merging o_proj: the reduce kernel and the
    skinny GEMV's residual epilogue, one launch fewer."""
    dtype, heads, head_dim = torch.float16, 8, 32
    q, k_cache, v_cache, meta = make_batch([75], [1], num_heads=heads, num_kv_heads=2,
                                           head_dim=head_dim, block_size=16, dtype=dtype, seed=7)
    k, v, positions, rotary, norms = new_token_inputs(q, 2, meta, qk_norm, seed=8)
    weights = () if not qk_norm else (norms[0].weight, norms[1].weight, norms[0].eps)

    def attend(keep_partials: bool, caches: tuple[torch.Tensor, torch.Tensor]):
        return decode_attention(q, *caches, meta.block_tables, meta.seq_lens,
                                meta.query_start_loc, meta.max_seq_len, head_dim ** -0.5,
                                num_splits=3, keep_partials=keep_partials,
                                new_tokens=NewTokens(k, v, positions, meta.slot_mapping,
                                                     rotary.cos_sin, *weights))

    gen = torch.Generator().manual_seed(9)
    weight = torch.randn(24, heads * head_dim, generator=gen).div(16).to(dtype)
    residual = torch.randn(1, 24, generator=gen).to(dtype)
    expected, expected_squares = residual.clone(), torch.zeros(1, dtype=torch.float64)
    skinny_linear(attend(False, (k_cache.clone(), v_cache.clone())).reshape(1, -1), weight,
                  residual=expected, sum_squares=expected_squares)
    lse, out = attend(True, (k_cache, v_cache))
    assert lse.shape == (1, heads, 3) and out.shape == (1, heads, 3, head_dim)
    assert out.dtype == dtype
    sum_squares = torch.zeros(1, dtype=torch.float64)
    merged_o_proj(lse, out, weight, residual, sum_squares)
    torch.testing.assert_close(residual, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(sum_squares, expected_squares, rtol=1e-3, atol=1e-3)


def test_rejects_inputs_it_cannot_merge():
    lse, out = random_partials(4, 2, 16, torch.float32, seed=1, empty=[])
    weight, residual = torch.randn(8, 64), torch.zeros(1, 8)
    with pytest.raises(ValueError, match="one sequence"):
        merged_o_proj(lse.expand(2, -1, -1), out.expand(2, -1, -1, -1), weight, residual)
    with pytest.raises(ValueError, match="weight"):
        merged_o_proj(lse, out, torch.randn(8, 60), residual)
    with pytest.raises(ValueError, match="residual"):
        merged_o_proj(lse, out, weight, torch.zeros(1, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="divide"):
        merged_o_proj(lse, out, weight, residual, config=MergedConfig(4, 3, 1))
    with pytest.raises(ValueError, match="float64"):
        merged_o_proj(lse, out, weight, residual, torch.zeros(1))


def test_o_proj_layer_takes_split_partials_and_adds_into_the_residual():
    """``RowParallelLinear.forward_for_norm`` with ``SplitPartials``: the merging kernel, and the
    marker that the norm after it must read the residual alone; CPU weights never ask for
    partials (the flag the attention backend is given)."""
    o_proj = RowParallelLinear(4 * 16, 24)
    o_proj.weight.data.normal_(0, 0.1)
    assert not o_proj.merges_split_partials
    lse, out = random_partials(4, 3, 16, torch.float32, seed=5, empty=[(2, 1)])
    residual = torch.randn(1, 24, generator=torch.Generator().manual_seed(6))
    expected = residual.double() + merged_reference(lse, out) @ o_proj.weight.double().T
    # Slots for up to four rows; one sequence takes one.
    o_proj.sum_squares = torch.zeros(4, dtype=torch.float64)
    marker, updated = o_proj.forward_for_norm(SplitPartials(lse, out), residual)
    assert isinstance(marker, AddedToResidual) and marker.sum_squares.shape == (1,)
    assert marker.sum_squares.data_ptr() == o_proj.sum_squares.data_ptr()
    assert updated is residual
    torch.testing.assert_close(residual.double(), expected, **TOLERANCE[torch.float32])
    torch.testing.assert_close(o_proj.sum_squares[:1],
                               residual.double().square().sum().reshape(1))
    assert torch.equal(o_proj.sum_squares[1:], torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("seq_lens", [[140], [140, 90]], ids=["batch1", "batch2"])
def test_backend_leaves_partials_only_at_batch_1_and_when_allowed(seq_lens):
    def attend(partials_ok: bool):
        q, k_cache, v_cache, meta = make_batch(seq_lens, [1] * len(seq_lens), num_heads=4,
                                               num_kv_heads=2, head_dim=32, block_size=16,
                                               seed=11)
        k, v, positions, rotary, norms = new_token_inputs(q, 2, meta, True, seed=12)
        return TritonAttentionBackend().attention(positions, q, k, v, k_cache, v_cache, meta,
                                                  rotary, 32 ** -0.5, *norms,
                                                  partials_ok=partials_ok)

    merged, allowed = attend(False), attend(True)
    assert isinstance(merged, torch.Tensor)
    if len(seq_lens) > 1:
        assert isinstance(allowed, torch.Tensor)
        return
    assert isinstance(allowed, SplitPartials) and allowed.lse.shape[-1] > 1
    torch.testing.assert_close(merged_reference(allowed.lse, allowed.out).float(),
                               merged.reshape(1, -1), **TOLERANCE[torch.float32])
