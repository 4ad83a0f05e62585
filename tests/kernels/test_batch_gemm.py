"""The batch GEMM (decode projections at 2-256 rows) against float64, on the CPU interpreter."""
import os

# Must precede any triton import: the kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nanoserve.kernels.batch_gemm import (  # noqa: E402
    MAX_ROWS,
    BatchGemmConfig,
    batch_linear,
    batch_norm_linear,
)
from nanoserve.layers.activation import silu_and_mul_torch  # noqa: E402

# fp32 differs from float64 by summation order; fp16 by that and one final rounding.
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).to(x.dtype)


def rms_norm_float64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [2, 16, 37])  # below, at and across row tiles of 16
@pytest.mark.parametrize("n,k", [(48, 64), (37, 100), (16, 256)])
def test_matches_float64(dtype, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).div(k ** 0.5).to(dtype)
    torch.testing.assert_close(batch_linear(x, w), reference(x, w), **TOLERANCE[dtype])


@pytest.mark.parametrize("config", [
    BatchGemmConfig(16, 16, 32, 1, 1), BatchGemmConfig(32, 16, 16, 1, 1),
    BatchGemmConfig(16, 64, 64, 2, 2), BatchGemmConfig(64, 32, 128, 4, 3)])
def test_every_tiling_gives_the_same_product(config):
    """The sweep's configurations (benchmarks/batch_gemm.py) must all be correct, not just one."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 96, generator=gen)
    w = torch.randn(41, 96, generator=gen)
    torch.testing.assert_close(batch_linear(x, w, config=config), reference(x, w),
                               **TOLERANCE[torch.float32])
    gated_x = torch.cat([x, x.flip(1)], 1)
    torch.testing.assert_close(batch_linear(gated_x, w, gated=True, config=config),
                               reference(silu_and_mul_torch(gated_x), w), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k", [(3, 24, 64), (20, 40, 100)])
def test_gated_input_applies_silu_and_mul_first(dtype, m, n, k):
    """The down projection of an MLP: x = [gate | up], product with silu(gate) * up."""
    gen = torch.Generator().manual_seed(k + m)
    x = torch.randn(m, 2 * k, generator=gen).mul(3).to(dtype)
    w = torch.randn(n, k, generator=gen).div(k ** 0.5).to(dtype)
    torch.testing.assert_close(batch_linear(x, w, gated=True),
                               reference(silu_and_mul_torch(x), w), **TOLERANCE[dtype])
    with pytest.raises(ValueError, match="when gated"):
        batch_linear(x[:, :k + 1], w, gated=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k", [(2, 24, 64), (19, 40, 100)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_input_applies_add_rms_norm_first(dtype, m, n, k, with_residual):
    """The qkv and gate/up projections: the pre-norm (and its residual add) fused. The kernel
    scales after the product, so it is checked against float64 maths, not the 16-bit path."""
    gen = torch.Generator().manual_seed(k + m + with_residual)
    x = torch.randn(m, k, generator=gen).mul(3).to(dtype)
    residual = torch.randn(m, k, generator=gen).to(dtype) if with_residual else None
    norm_w = (1 + 0.3 * torch.randn(k, generator=gen)).to(dtype)
    w = torch.randn(n, k, generator=gen).div(k ** 0.5).to(dtype)
    eps = 1e-6
    summed = x if residual is None else x + residual
    residual_before = None if residual is None else residual.clone()
    y, out_residual = batch_norm_linear(x, residual, norm_w, eps, w)
    expected = (rms_norm_float64(summed, norm_w, eps) @ w.double().T).to(dtype)
    torch.testing.assert_close(y, expected, **TOLERANCE[dtype])
    assert torch.equal(out_residual, summed)
    if with_residual:  # out of place: the caller's residual is left as it was
        assert out_residual.data_ptr() != residual.data_ptr()
        assert torch.equal(residual, residual_before)


def test_norm_input_rejects_bad_weights_and_residuals():
    x, w = torch.randn(2, 64), torch.randn(8, 64)
    with pytest.raises(ValueError, match="norm weight"):
        batch_norm_linear(x, None, torch.ones(63), 1e-6, w)
    with pytest.raises(ValueError, match="norm weight"):
        batch_norm_linear(x, None, torch.ones(64, dtype=torch.float16), 1e-6, w)
    with pytest.raises(ValueError, match="residual"):
        batch_norm_linear(x, torch.randn(2, 32), torch.ones(64), 1e-6, w)


def test_strided_rows_of_x():
    """A row-strided x (a slice of a wider activation) is read in place."""
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(18, 200, generator=gen)
    x = wide[:, 10:74]
    w = torch.randn(24, 64, generator=gen)
    torch.testing.assert_close(batch_linear(x, w), reference(x, w), **TOLERANCE[torch.float32])


def test_rejects_too_many_rows_and_mismatched_shapes():
    with pytest.raises(ValueError, match="at most"):
        batch_linear(torch.zeros(MAX_ROWS + 1, 16), torch.zeros(4, 16))
    with pytest.raises(ValueError, match="contiguous rows"):
        batch_linear(torch.zeros(2, 16), torch.zeros(4, 6))


def test_empty_batch():
    assert batch_linear(torch.zeros(0, 16), torch.zeros(4, 16)).shape == (0, 4)
