"""Fused RMSNorm / SiLU*mul kernels against PyTorch, on the CPU interpreter."""
import os

# Must precede any triton import: the kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from nanoserve.kernels.fused_ops import (  # noqa: E402
    RmsNormConfig,
    SiluAndMulConfig,
    rms_norm,
    rms_norm_candidates,
    silu_and_mul,
    silu_and_mul_candidates,
)

# fp32 differs from PyTorch only by summation order and exp/rsqrt rounding; 16-bit outputs may
# flip one ulp (~1e-3 relative) where the fp32 value sits near a rounding boundary.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-3, rtol=2e-3)}
DTYPES = [torch.float32, torch.float16]
EPS = 1e-6
# In fp16, rounding at a different point than PyTorch (e.g. skipping the cast before the weight
# multiply) changes ~25% of outputs by an ulp; matching the order leaves well under 1% different.
MAX_DIFFERENT_FRACTION = 0.01


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Close to the reference; in fp16 also bit-identical almost everywhere (rounding order)."""
    torch.testing.assert_close(actual, expected, **TOLERANCE[expected.dtype])
    if expected.dtype == torch.float16:
        assert (actual != expected).float().mean().item() <= MAX_DIFFERENT_FRACTION


def ref_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(dtype) * w


def fused_qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
              dtype: torch.dtype, gen: torch.Generator
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused qkv projection output and its q, k, v ``[T, H, D]`` views (strided rows)."""
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    qkv = (2 * qkv).to(dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    return (qkv, q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim),
            v.view(-1, num_kv_heads, head_dim))


def random_weight(dim: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return (1 + 0.2 * torch.randn(dim, generator=gen)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [96, 576, 1024, 8192])
def test_rms_norm_rows(dtype, dim):
    gen = torch.Generator().manual_seed(dim)
    # Rows of a wider buffer: the row stride is not the row length.
    wide = (3 * torch.randn(7, dim + 32, generator=gen) + 0.5).to(dtype)
    x = wide[:, 16:16 + dim]
    w = random_weight(dim, dtype, gen)
    out = rms_norm(x, w, EPS)
    assert out.dtype == dtype and out.is_contiguous()
    assert_matches(out, ref_rms_norm(x, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 96])
def test_rms_norm_qk_heads(dtype, head_dim):
    """Qwen3's per-head q/k norm on [T, H, D] views of the fused qkv output; qkv is left intact."""
    gen = torch.Generator().manual_seed(head_dim)
    qkv, q, k, _ = fused_qkv(5, 6, 2, head_dim, dtype, gen)
    before = qkv.clone()
    wq, wk = random_weight(head_dim, dtype, gen), random_weight(head_dim, dtype, gen)
    assert_matches(rms_norm(q, wq, EPS), ref_rms_norm(q, wq, EPS))
    assert_matches(rms_norm(k, wk, EPS), ref_rms_norm(k, wk, EPS))
    assert torch.equal(qkv, before)


def test_rms_norm_promotes_to_weight_dtype():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 96, generator=gen).half()
    w = random_weight(96, torch.float32, gen)
    out = rms_norm(x, w, EPS)
    assert out.dtype == torch.float32
    assert_matches(out, ref_rms_norm(x, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_without_weight_is_the_scale_alone(dtype):
    """A norm folded into the projection after it has a weight of ones: none is read."""
    gen = torch.Generator().manual_seed(3)
    x = (3 * torch.randn(4, 1100, generator=gen)).to(dtype)  # masked lanes add nothing
    out = rms_norm(x, None, EPS)
    assert out.dtype == dtype
    assert_matches(out, ref_rms_norm(x, torch.ones(1100, dtype=dtype), EPS))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(100) -> inf, as intended
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [96, 1100])
def test_silu_and_mul(dtype, n):
    """n = 1100 spans two column tiles, the second one partial."""
    gen = torch.Generator().manual_seed(n)
    x = (3 * torch.randn(5, 2 * n + 16, generator=gen)).to(dtype)[:, :2 * n]  # strided rows
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -20.0], dtype=dtype)  # saturated silu
    gate, up = x.chunk(2, dim=-1)
    out = silu_and_mul(x)
    assert out.shape == (5, n) and out.dtype == dtype
    assert_matches(out, F.silu(gate) * up)


def test_every_candidate_launch_computes_the_same():
    """A tuner times each candidate launch: each must compute the op (SiLU tiles of 256 split
    a 300-wide row into a whole tile and a partial one)."""
    gen = torch.Generator().manual_seed(6)
    x = (3 * torch.randn(3, 600, generator=gen)).half()
    w = random_weight(300, torch.float16, gen)
    norm_launches = rms_norm_candidates(300)
    silu_launches = silu_and_mul_candidates(300)
    assert RmsNormConfig(16) in norm_launches and SiluAndMulConfig(256, 2) in silu_launches
    for config in norm_launches:
        assert_matches(rms_norm(x[:, :300], w, EPS, config), ref_rms_norm(x[:, :300], w, EPS))
    gate, up = x.chunk(2, dim=-1)
    for config in silu_launches:
        assert_matches(silu_and_mul(x, config), F.silu(gate) * up)


def test_empty_batch():
    """A zero-token step launches nothing and returns empty results."""
    w = torch.ones(64)
    assert rms_norm(torch.empty(0, 64), w, EPS).shape == (0, 64)
    assert silu_and_mul(torch.empty(0, 128)).shape == (0, 64)
