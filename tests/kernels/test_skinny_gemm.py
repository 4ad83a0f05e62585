"""The skinny GEMM (decode-time projections) against a float64 matmul, on the CPU interpreter."""
import os

# Must precede any triton import: the kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nanoserve.kernels.skinny_gemm import (  # noqa: E402
    MAX_ROWS,
    SkinnyConfig,
    skinny_linear,
)
from nanoserve.layers.activation import silu_and_mul_torch  # noqa: E402

# fp32 differs from float64 by summation order; fp16 by that and one final rounding.
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    if b is not None:
        out += b.double()
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("n,k", [(48, 64), (37, 100), (8, 256)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64(dtype, m, n, k, with_bias):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).div(k ** 0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    torch.testing.assert_close(skinny_linear(x, w, b), reference(x, w, b), **TOLERANCE[dtype])


@pytest.mark.parametrize("config", [
    SkinnyConfig(8, 32, 1, 1), SkinnyConfig(16, 64, 2, 2), SkinnyConfig(4, 128, 1, 1),
    SkinnyConfig(1, 32, 1, 1), SkinnyConfig(8, 32, 1, 1, defer_sum=True),
    SkinnyConfig(2, 64, 1, 1, defer_sum=True), SkinnyConfig(4, 128, 1, 1, defer_sum=True),
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_tiling_gives_the_same_product(config, with_bias):
    """Every tiling the tuner may pick (``kernels/tune.py``) must be correct, not just one."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 96, generator=gen)
    w = torch.randn(41, 96, generator=gen)
    b = torch.randn(41, generator=gen) if with_bias else None
    torch.testing.assert_close(skinny_linear(x, w, b, config=config), reference(x, w, b),
                               **TOLERANCE[torch.float32])
    gate_up, gate_up_bias = torch.cat([w, w.flip(0)]), torch.cat([b, -b]) if with_bias else None
    act = skinny_linear(x, gate_up, gate_up_bias, config=config, activate=True)
    torch.testing.assert_close(act, silu_and_mul_torch(reference(x, gate_up, gate_up_bias)),
                               **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,features,k,config", [
    (1, 24, 64, SkinnyConfig(8, 64, 1, 1)), (3, 21, 100, SkinnyConfig(4, 32, 2, 1)),
    (2, 9, 40, SkinnyConfig(2, 16, 1, 1, defer_sum=True)), (1, 5, 48, SkinnyConfig(1, 64, 1, 1)),
])
@pytest.mark.parametrize("normed", [False, True])
def test_activate_writes_silu_and_mul_of_gate_up(dtype, m, features, k, config, normed):
    """The MLP's gate/up at batch 1: W = [gate; up], each program taking the same features of
    both halves (the last one masked where they do not divide), the output silu(gate) * up of
    the rounded product, as the two-step path takes it (up to silu's own rounding)."""
    gen = torch.Generator().manual_seed(features * 10 + m)
    x = torch.randn(m, k, generator=gen).mul(2).to(dtype)
    w = torch.randn(2 * features, k, generator=gen).div(k ** 0.5).to(dtype)
    b = torch.randn(2 * features, generator=gen).to(dtype)
    if normed:
        act = skinny_linear(x, w, b, config=config, norm_eps=1e-6, activate=True)
        two_step = skinny_linear(x, w, b, config=config, norm_eps=1e-6)
    else:
        act = skinny_linear(x, w, b, config=config, activate=True)
        two_step = skinny_linear(x, w, b, config=config)
        torch.testing.assert_close(two_step, reference(x, w, b), **TOLERANCE[dtype])
    assert act.shape == (m, features)
    torch.testing.assert_close(act, silu_and_mul_torch(two_step), **TOLERANCE[dtype])
    with pytest.raises(ValueError, match="even number of rows"):
        skinny_linear(x, w[1:], activate=True)


RMS_CASES = [(1, 24, 64, SkinnyConfig(8, 64, 1, 1)), (2, 40, 100, SkinnyConfig(16, 32, 2, 1)),
             (1, 17, 96, SkinnyConfig(2, 128, 1, 1, defer_sum=True)),
             (3, 9, 200, SkinnyConfig(4, 64, 1, 1, defer_sum=True)),
             (8, 12, 96, SkinnyConfig(4, 32, 1, 1))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k,config", RMS_CASES)
def test_rms_input_normalises_each_row(dtype, m, n, k, config):
    """qkv and gate/up at decode batches: RMSNorm of the residual stream h (its weight folded
    into W) applied to the product, each row's sum of squares taken as the kernel streams x,
    whether K takes one chunk or several, masked or not."""
    gen = torch.Generator().manual_seed(k + m)
    h = torch.randn(m, k, generator=gen).mul(3).to(dtype)
    w = torch.randn(n, k, generator=gen).div(k ** 0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    eps = 1e-6
    hd = h.double()
    normed = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + eps)
    expected = (normed @ w.double().T + b.double()).to(dtype)
    torch.testing.assert_close(skinny_linear(h, w, b, config=config, norm_eps=eps),
                               expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m", [1, 3])
def test_residual_epilogue_adds_the_product_in_place(dtype, with_bias, m):
    """o_proj and down_proj at decode batches: the product goes into the residual stream in
    place, rounded as ``F.linear(...) + residual`` rounds (the product first, then the sum)."""
    gen = torch.Generator().manual_seed(7 + 2 * with_bias + m)
    k, n = 100, 37  # 37 features over 8-wide programs: a masked last program
    x = torch.randn(m, k, generator=gen).mul(2).to(dtype)
    w = torch.randn(n, k, generator=gen).div(k ** 0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    residual = (4 * torch.randn(m, n, generator=gen)).to(dtype)
    product = skinny_linear(x, w, b, config=SkinnyConfig(8, 32, 1, 1))
    expected = product + residual
    out = skinny_linear(x, w, b, residual=residual, config=SkinnyConfig(8, 32, 1, 1))
    assert out is residual
    assert torch.equal(residual, expected)
    with pytest.raises(ValueError, match="residual"):
        skinny_linear(x, w, b, residual=torch.zeros(m, n + 1, dtype=dtype))
    with pytest.raises(ValueError, match="no residual"):
        skinny_linear(x, torch.cat([w, w]), residual=torch.zeros(m, 2 * n, dtype=dtype),
                      activate=True)


def test_strided_rows_of_x():
    """A row-strided x (a slice of a wider activation) is read in place."""
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(3, 200, generator=gen)
    x = wide[:, 10:74]
    w = torch.randn(24, 64, generator=gen)
    torch.testing.assert_close(skinny_linear(x, w), reference(x, w, None),
                               **TOLERANCE[torch.float32])


def test_rejects_too_many_rows_and_mismatched_shapes():
    with pytest.raises(ValueError, match="at most"):
        skinny_linear(torch.zeros(MAX_ROWS + 1, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="contiguous rows"):
        skinny_linear(torch.zeros(2, 8), torch.zeros(4, 6))


def test_empty_batch():
    assert skinny_linear(torch.zeros(0, 8), torch.zeros(4, 8)).shape == (0, 4)


def test_interpreter_never_uses_programmatic_launch():
    """gdc_wait / launch_pdl exist only on Hopper GPUs; the CPU path must never ask for them."""
    from nanoserve.kernels.common import programmatic_launch
    assert not programmatic_launch(torch.device("cpu"))


def test_folded_projection_applies_its_norm_in_the_kernel():
    """The layer contract: a projection carrying its norm's weight (``fold_norm``) and handed
    the norm gives ``linear(norm(x))``; the op applies each row's 1 / rms itself."""
    from nanoserve.layers.linear import ColumnParallelLinear
    from nanoserve.layers.norm import RMSNorm, rms_norm_torch

    gen = torch.Generator().manual_seed(5)
    k, n = 64, 24
    residual = 3 * torch.randn(2, k, generator=gen)
    norm = RMSNorm(k, eps=1e-6)
    norm.weight.copy_(1 + 0.3 * torch.randn(k, generator=gen))
    proj = ColumnParallelLinear(k, n)
    proj.weight.copy_(torch.randn(n, k, generator=gen).div(k ** 0.5))
    expected = rms_norm_torch(residual, norm.weight, 1e-6) @ proj.weight.T
    torch.testing.assert_close(proj(residual, norm=norm), expected, **TOLERANCE[torch.float32])
    proj.fold_norm(norm)
    assert norm.folded and torch.equal(norm.weight, torch.ones(k))
    torch.testing.assert_close(proj(residual, norm=norm), expected, **TOLERANCE[torch.float32])
    torch.testing.assert_close(skinny_linear(residual, proj.weight, norm_eps=1e-6), expected,
                               **TOLERANCE[torch.float32])


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n,k", [(48, 64), (37, 100)])
def test_fp8_weight_with_channel_scales_matches_float64(m, n, k):
    """e4m3 codes times a float32 scale an output feature, as the FP8 decode path feeds it."""
    from nanoserve.layers.quantization.fp8 import quantize_weight_per_channel

    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).to(torch.float16)
    b = torch.randn(n, generator=gen).to(torch.float16)
    q, scale = quantize_weight_per_channel(torch.randn(n, k, generator=gen) / k ** 0.5)
    want = reference(x, q.double() * scale.double(), b)
    got = skinny_linear(x, q, b, weight_scale=scale[:, 0].contiguous())
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float16])
    with pytest.raises(ValueError, match="weight_scale"):
        skinny_linear(x, q, b, weight_scale=scale)  # [N, 1]: not the [N] it takes
