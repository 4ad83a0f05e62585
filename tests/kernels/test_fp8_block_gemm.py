"""The Triton block-scaled FP8 GEMM against float64 on both sides' dequantized values, on the
interpreter."""
import os

# Must precede any triton import: the kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nanoserve.kernels.fp8_block_gemm import Fp8BlockConfig, fp8_block_linear  # noqa: E402
from nanoserve.layers.quantization.fp8 import Fp8Matrix, quantize_rows  # noqa: E402


@pytest.mark.parametrize("m,n,k,block,config", [
    (1, 64, 64, (32, 32), None), (5, 96, 128, (32, 64), None), (20, 32, 64, (16, 32), None),
    # launches other than select's, as the tuner tries them
    (20, 64, 64, (32, 32), Fp8BlockConfig(32, 16, 4, 2)),  # tiles inside a scale block
    (5, 96, 128, (16, 64), Fp8BlockConfig(16, 64, 8, 4)),  # a tile over 4 scale blocks
    (40, 32, 64, (32, 32), Fp8BlockConfig(16, 32, 2, 1)),  # three row blocks, the last short
])
def test_fp8_block_gemm_matches_float64(m, n, k, block, config):
    gen = torch.Generator().manual_seed(m + n + k)
    bn, bk = block
    w = torch.randn(n, k, generator=gen) * 0.1
    tiles = w.view(n // bn, bn, k // bk, bk)
    sw = tiles.abs().amax((1, 3)) / 448
    wq = (tiles / sw[:, None, :, None]).to(torch.float8_e4m3fn).view(n, k)
    x = torch.randn(m, k, generator=gen)
    xq, sx = quantize_rows(x, bk)
    xd = (xq.double().view(m, -1, bk) * sx.double()[..., None]).view(m, k)
    want = xd @ Fp8Matrix(wq, sw, block).dequantize().double().t()
    got = fp8_block_linear(xq, sx, wq, sw, block, torch.float32, config)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max())
