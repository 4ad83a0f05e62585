"""The few-rows GEMM (small decode batches, fused epilogues) against float64, on the CPU
interpreter."""
import os

# Must precede any triton import: the kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nanoserve.kernels.few_rows_gemm import (  # noqa: E402
    MAX_ROWS,
    FewRowsConfig,
    few_rows_linear,
    few_rows_rms_linear,
)
from nanoserve.layers.activation import silu_and_mul_torch  # noqa: E402

# fp32 differs from float64 by summation order; fp16 by that and one final rounding.
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3)}
EPS = 1e-6


def normalised(h: torch.Tensor) -> torch.Tensor:
    hd = h.double()
    return hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + EPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [2, 5, 16, 33])
@pytest.mark.parametrize("n,k", [(48, 64), (37, 100), (16, 256)])
def test_matches_float64(dtype, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).div(k ** 0.5).to(dtype)
    expected = (x.double() @ w.double().T).to(dtype)
    torch.testing.assert_close(few_rows_linear(x, w), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("config", [FewRowsConfig(16, 16, 1, 1), FewRowsConfig(32, 64, 2, 2),
                                    FewRowsConfig(64, 32, 4, 3), FewRowsConfig(16, 128, 4, 4)])
def test_every_tiling_gives_the_same_product(config):
    """Tilings a sweep may pick (benchmarks/few_rows_gemm.py) must all be correct, with
    features and K that are not multiples of the tiles."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 200, generator=gen)
    w = torch.randn(41, 200, generator=gen)
    torch.testing.assert_close(few_rows_linear(x, w, config=config),
                               (x.double() @ w.double().T).float(), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k", [(2, 24, 64), (9, 40, 100), (20, 17, 96)])
def test_rms_input_normalises_each_row(dtype, m, n, k):
    """qkv at a few rows: RMSNorm of the residual stream h (its weight folded into W, its rows'
    sums of squares given) applied to the product."""
    gen = torch.Generator().manual_seed(k + m)
    h = torch.randn(m, k, generator=gen).mul(3).to(dtype)
    w = torch.randn(n, k, generator=gen).div(k ** 0.5).to(dtype)
    sum_squares = h.double().pow(2).sum(-1).float()
    expected = (normalised(h) @ w.double().T).to(dtype)
    torch.testing.assert_close(few_rows_rms_linear(h, sum_squares, EPS, w), expected,
                               **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,inter,k", [(3, 24, 64), (12, 37, 100)])
def test_gate_up_writes_silu_and_mul_of_its_two_halves(dtype, m, inter, k):
    """gate/up at a few rows: W is [gate; up] and the output is silu(gate) * up, each half
    rounded as the unfused product would be, then as ``silu_and_mul`` rounds."""
    gen = torch.Generator().manual_seed(3 * m + inter)
    h = torch.randn(m, k, generator=gen).mul(3).to(dtype)
    w = torch.randn(2 * inter, k, generator=gen).div(k ** 0.5).to(dtype)
    sum_squares = h.double().pow(2).sum(-1).float()
    product = (normalised(h) @ w.double().T).to(dtype)
    out = few_rows_rms_linear(h, sum_squares, EPS, w, gate_up=True)
    assert out.shape == (m, inter)
    torch.testing.assert_close(out, silu_and_mul_torch(product), **TOLERANCE[dtype])
    with pytest.raises(ValueError, match="gate_up"):
        few_rows_rms_linear(h, sum_squares, EPS, w[1:], gate_up=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [2, 17])
def test_residual_epilogue_adds_in_place_and_sums_squares_for_the_next_norm(dtype, m):
    """o_proj / down_proj at a few rows: the product goes into the residual stream in place,
    rounded as ``F.linear(...) + residual`` rounds, and each updated row's sum of squares (from
    several programs) lands in its slot, for the next projection to normalise with."""
    gen = torch.Generator().manual_seed(11 + m)
    k, n, n_next = 72, 37, 29  # 37 features over 16-wide programs: a masked last program
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).div(k ** 0.5).to(dtype)
    residual = (3 * torch.randn(m, n, generator=gen)).to(dtype)
    expected = few_rows_linear(x, w) + residual
    sum_squares = torch.zeros(m)
    out = few_rows_linear(x, w, residual=residual, sum_squares=sum_squares)
    assert out is residual
    assert torch.equal(residual, expected)
    torch.testing.assert_close(sum_squares, residual.double().pow(2).sum(-1).float(),
                               atol=1e-5, rtol=1e-5)
    w_next = torch.randn(n_next, n, generator=gen).div(n ** 0.5).to(dtype)
    given = few_rows_rms_linear(residual, sum_squares, EPS, w_next)
    torch.testing.assert_close(given, (normalised(residual) @ w_next.double().T).to(dtype),
                               **TOLERANCE[dtype])


def test_strided_rows_of_x():
    """A row-strided x (a slice of a wider activation) is read in place."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 200, generator=gen)[:, 10:74]
    w = torch.randn(24, 64, generator=gen)
    torch.testing.assert_close(few_rows_linear(x, w), (x.double() @ w.double().T).float(),
                               **TOLERANCE[torch.float32])


def test_rejects_bad_shapes_and_slots():
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match="at most"):
        few_rows_linear(torch.zeros(MAX_ROWS + 1, 16), w)
    with pytest.raises(ValueError, match="contiguous rows"):
        few_rows_linear(x, torch.zeros(4, 6))
    with pytest.raises(ValueError, match="needs residual"):
        few_rows_linear(x, w, sum_squares=torch.zeros(2))
    with pytest.raises(ValueError, match="sum_squares"):
        few_rows_linear(x, w, residual=torch.zeros(2, 8), sum_squares=torch.zeros(3))
    with pytest.raises(ValueError, match="residual"):
        few_rows_linear(x, w, residual=torch.zeros(2, 9))


def test_empty_batch():
    assert few_rows_linear(torch.zeros(0, 8), torch.zeros(4, 8)).shape == (0, 4)


def test_mlp_layers_hand_the_activation_from_gate_up_to_down():
    """The layer contract at a few rows: after a producer that added into the residual and
    summed its squares, the folded gate/up applies the norm and SiLU-and-mul in its kernel
    (``Activated``), and the gated down projection takes that as its input as it is."""
    from nanoserve.layers.activation import Activated
    from nanoserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear
    from nanoserve.layers.norm import AddedToResidual, RMSNorm, rms_norm_torch

    gen = torch.Generator().manual_seed(5)
    m, hidden, inter = 3, 64, 40
    residual = 3 * torch.randn(m, hidden, generator=gen)
    norm = RMSNorm(hidden, eps=EPS)
    norm.weight.copy_(1 + 0.3 * torch.randn(hidden, generator=gen))
    gate_up = MergedColumnParallelLinear(hidden, [inter, inter])
    gate_up.weight.copy_(torch.randn(2 * inter, hidden, generator=gen).div(hidden ** 0.5))
    down = RowParallelLinear(inter, hidden, gated=True)
    down.weight.copy_(torch.randn(hidden, inter, generator=gen).div(inter ** 0.5))
    activation = silu_and_mul_torch(rms_norm_torch(residual, norm.weight, EPS) @ gate_up.weight.T)
    gate_up.fold_norm(norm)
    sums = residual.pow(2).sum(-1)
    out, stream = gate_up.forward_normed_gated(AddedToResidual(sums), residual, norm)
    assert isinstance(out, Activated) and stream is residual
    torch.testing.assert_close(out.values, activation, **TOLERANCE[torch.float32])
    down_out, _ = down.forward_for_norm(out, residual)
    torch.testing.assert_close(down_out, activation @ down.weight.T, **TOLERANCE[torch.float32])
