"""On a CUDA device: the int4 paths (the skinny GEMV, the tensor-core kernel, dequantize then
cuBLAS) at a real projection size against a float64 matmul, the dispatch by rows, split K and
capture in a CUDA graph. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

N, K, G = 4096, 4096, 128


def operands(m: int, n: int = N, k: int = K, dtype: torch.dtype = torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    codes = torch.randint(0, 16, (n, k), generator=gen, device="cuda", dtype=torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scales = torch.rand(k // G, n, generator=gen, device="cuda") * 0.004 + 0.001
    zeros = torch.randn(k // G, n, generator=gen, device="cuda") * 0.01
    sz = torch.stack([scales, zeros], -1).to(dtype)
    x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
    return x, packed, sz, reference(x, codes, sz)


def reference(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """``x W^T`` in float64, W from its codes as the CPU path dequantizes them."""
    from nanoserve.layers.quantization.packed import int4_matmul_reference

    return int4_matmul_reference(x.double(), codes, sz.double(), G)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2 * want.abs().max())


@pytest.mark.parametrize("m", [1, 4, 8, 64, 300])
def test_int4_paths_match_float64(m):
    from nanoserve.kernels.int4_gemm import DEQUANT, GEMV, TENSOR_CORE, int4_linear, int4_path

    x, packed, sz, want = operands(m)
    # Up to 8 rows a tuning file may leave a bucket to the tensor-core kernel.
    allowed = {GEMV, TENSOR_CORE} if m <= 8 else {TENSOR_CORE if m < 256 else DEQUANT}
    assert int4_path(m, N, K, x.device) in allowed
    got = int4_linear(x, packed, sz, G)
    assert got.dtype == torch.bfloat16 and got.shape == (m, N)
    assert_close(got, want)
    for path in (GEMV, TENSOR_CORE, DEQUANT):
        if path == GEMV and m > 8:
            continue
        assert_close(int4_linear(x, packed, sz, G, path), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k", [(24576, 4096), (4096, 12288), (1024, 4096)])  # 8B gate_up, down
def test_int4_gemv_shapes_and_splits(n, k, dtype):
    """Each row bucket with the heuristic's tiles, and split K forced."""
    from nanoserve.kernels.int4_gemv import Int4GemvConfig, heuristic_config, int4_gemv

    for m in (1, 2, 3, 8):
        x, packed, sz, want = operands(m, n, k, dtype)
        assert_close(int4_gemv(x, packed, sz, G), want)
        cfg = heuristic_config(m, n, k, 132)
        assert_close(int4_gemv(x, packed, sz, G, cfg._replace(split_k=4)), want)
    x, packed, sz, want = operands(1, n, k, dtype)
    assert_close(int4_gemv(x, packed, sz, G, Int4GemvConfig(8, 1024, split_k=3)), want)


@pytest.mark.parametrize("m,split", [(1, None), (4, None), (1, 4)])
def test_int4_gemv_in_a_cuda_graph(m, split):
    """Captured (the decode steps are): no host sync, scratch from the graph's pool; replays
    follow x's new values. ``split``: K in that many slices (fp32 scratch and atomics)."""
    from nanoserve.kernels.int4_gemv import Int4GemvConfig, int4_gemv

    x, packed, sz, _ = operands(m)
    cfg = Int4GemvConfig(8, 512, split_k=split) if split else None
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        int4_gemv(x, packed, sz, G, cfg)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int4_gemv(x, packed, sz, G, cfg)
    x2, _, _, _ = operands(m + 1000)
    x.copy_(x2[:m])
    graph.replay()
    torch.cuda.synchronize()
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1)
    assert_close(out, reference(x, codes, sz))
