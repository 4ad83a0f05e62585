"""The batch GEMM (decode projections at 2-256 rows) against float64, on the CPU interpreter."""
import os

# Must precede any triton import: the kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nanoserve.kernels.batch_gemm import (  # noqa: E402
    MAX_ROWS,
    PREFETCH_ALIGN,
    BatchGemmConfig,
    batch_linear,
    prefetch_plan,
)

# fp32 differs from float64 by summation order; fp16 by that and one final rounding.
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).to(x.dtype)


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
    """The sweep's configurations (benchmarks/decode_forward.py) must all be correct."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 96, generator=gen)
    w = torch.randn(41, 96, generator=gen)
    torch.testing.assert_close(batch_linear(x, w, config=config), reference(x, w),
                               **TOLERANCE[torch.float32])


def test_strided_rows_are_read_in_place():
    """x may be a view with a row stride wider than K (a slice of a fused output)."""
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(5, 80, generator=gen)
    w = torch.randn(24, 48, generator=gen)
    torch.testing.assert_close(batch_linear(wide[:, 16:64], w), reference(wide[:, 16:64], w),
                               **TOLERANCE[torch.float32])


def test_bad_shapes_are_refused():
    x = torch.randn(MAX_ROWS + 1, 32)
    with pytest.raises(ValueError, match="at most"):
        batch_linear(x, torch.randn(16, 32))
    with pytest.raises(ValueError, match="contiguous"):
        batch_linear(torch.randn(4, 32), torch.randn(16, 33))
    with pytest.raises(ValueError, match="contiguous"):
        batch_linear(torch.randn(4, 32), torch.randn(32, 16).T)
    assert batch_linear(torch.randn(0, 32), torch.randn(16, 32)).shape == (0, 16)


@pytest.mark.parametrize("n,k,warps", [(4096, 1024, 4), (1024, 3072, 4), (6144, 1024, 8),
                                       (1024, 2048, 4)])
def test_prefetch_covers_exactly_the_slab(n, k, warps):
    """One bulk prefetch per thread, each aligned, together the program's rows of W."""
    cfg = BatchGemmConfig(64, 64, 128, warps, 3)
    chunks, nbytes = prefetch_plan(cfg, n, k, 2, pdl=True)
    assert chunks == 32 * warps
    assert chunks * nbytes == cfg.block_n * k * 2
    assert nbytes % PREFETCH_ALIGN == 0


def test_no_prefetch_without_programmatic_launch_or_on_ragged_tiles():
    cfg = BatchGemmConfig(64, 64, 128, 4, 3)
    assert prefetch_plan(cfg, 4096, 1024, 2, pdl=False) == (0, 0)
    assert prefetch_plan(cfg, 4100, 1024, 2, pdl=True) == (0, 0)  # last tile past N
    assert prefetch_plan(cfg, 4096, 8, 2, pdl=True) == (0, 0)  # 8 bytes per thread
