"""The Triton int4 GEMM (AWQ / GPTQ / GGUF 4-bit weights) against float64, on the interpreter."""
import os

# Must precede any triton import: the kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nanoserve.kernels.int4_gemm import int4_linear  # noqa: E402


@pytest.mark.parametrize("m,n,k,g", [(1, 48, 64, 32), (3, 40, 256, 128), (20, 64, 128, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int4_gemm_matches_float64(m, n, k, g, dtype):
    gen = torch.Generator().manual_seed(m + n + k)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scales = torch.rand(k // g, n, generator=gen) * 0.05 + 0.01
    zeros = torch.randn(k // g, n, generator=gen) * 0.1
    sz = torch.stack([scales, zeros], -1).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    s, z = (sz[..., i].double().repeat_interleave(g, 0).t() for i in (0, 1))
    want = x.double() @ ((codes.double() - 8) * s + z).t()
    got = int4_linear(x, packed, sz, g)
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 1e-4 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max())
