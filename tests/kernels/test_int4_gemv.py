"""The int4 GEMV (1-8 rows), the dequantize-then-matmul path and the dispatch between them and
the tensor-core kernel, against float64, on the interpreter."""
import os

# Must precede any triton import: the kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nanoserve.kernels import int4_gemm  # noqa: E402
from nanoserve.kernels.int4_gemm import (  # noqa: E402
    DEQUANT,
    DEQUANT_ROWS,
    GEMV,
    TENSOR_CORE,
    dequantize_int4,
    int4_linear,
    int4_path,
)
from nanoserve.kernels.int4_gemv import (  # noqa: E402
    HEURISTIC_TILES,
    Int4GemvConfig,
    from_table,
    heuristic_config,
    int4_gemv,
)
from nanoserve.layers.quantization.packed import int4_matmul_reference  # noqa: E402

CPU = torch.device("cpu")
# Relative to the largest output: fp32 differs from float64 by summation order, 16-bit x by
# that and one final rounding.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def operands(m: int, n: int, k: int, g: int, dtype: torch.dtype, seed: int = 0):
    """Fresh random codes, scales and zeros (in ``dtype``, as Int4Matrix keeps them) and x."""
    gen = torch.Generator().manual_seed(seed * 1000 + m * 100 + n + k + g)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scales = torch.rand(k // g, n, generator=gen) * 0.05 + 0.01
    zeros = torch.randn(k // g, n, generator=gen) * 0.1
    sz = torch.stack([scales, zeros], -1).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    return x, codes, packed, sz


def assert_matches(got, x, codes, sz, g):
    want = int4_matmul_reference(x.double(), codes, sz.double(), g)
    assert got.dtype == x.dtype and got.shape == want.shape
    tol = TOLERANCE[x.dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max())


@pytest.mark.parametrize("m,n,k,g", [(1, 48, 64, 32), (3, 40, 256, 128), (20, 64, 128, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int4_gemm_matches_float64(m, n, k, g, dtype):
    """The tensor-core kernel (any row count) against float64."""
    x, codes, packed, sz = operands(m, n, k, g, dtype)
    assert_matches(int4_linear(x, packed, sz, g, TENSOR_CORE), x, codes, sz, g)


DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(40, 256, 32), (24, 512, 128), (36, 768, 256)]  # N never a multiple of BLOCK_N 16


@pytest.mark.parametrize("rows", range(1, 9))
def test_gemv_matches_float64(rows):
    """Every row count, each with another dtype and K / group size."""
    dtype = DTYPES[rows % 3]
    n, k, g = SHAPES[rows % len(SHAPES)]
    x, codes, packed, sz = operands(rows, n, k, g, dtype)
    assert_matches(int4_gemv(x, packed, sz, g), x, codes, sz, g)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config,k,g", [
    (Int4GemvConfig(8, 256), 512, 64),  # several groups a chunk
    (Int4GemvConfig(4, 32), 256, 128),  # several chunks a group
    (Int4GemvConfig(8, 64, split_k=3), 448, 32),  # split K, the last split shorter
    (Int4GemvConfig(16, 128, split_k=2), 192, 64),  # K not a multiple of BLOCK_K
])
def test_gemv_tilings(config, k, g, dtype):
    x, codes, packed, sz = operands(3, 44, k, g, dtype, seed=1)
    assert_matches(int4_gemv(x, packed, sz, g, config), x, codes, sz, g)


def test_gemv_heuristic_tiles_on_the_interpreter():
    for rows in (1, 5):
        config = heuristic_config(rows, 24, 1024, sms=132)
        x, codes, packed, sz = operands(rows, 24, 1024, 128, torch.float32, seed=2)
        assert_matches(int4_gemv(x, packed, sz, 128, config), x, codes, sz, 128)


@pytest.mark.parametrize("n,k", [(4096, 4096), (24576, 4096), (4096, 12288), (1024, 2048),
                                 (151936, 1024), (8, 256), (4096, 2880)])
def test_heuristic_is_sound_for_any_shape(n, k):
    for rows in range(1, 9):
        cfg = heuristic_config(rows, n, k, sms=132)
        assert cfg.block_k & (cfg.block_k - 1) == 0 and k % cfg.block_k == 0  # no K masks
        assert cfg.block_n in {t[0] for t in HEURISTIC_TILES.values()}
        assert 1 <= cfg.split_k <= k // cfg.block_k
        if -(-n // cfg.block_n) >= (132 if rows == 1 else 4 * 132):
            assert cfg.split_k == 1  # enough row blocks: no fp32 scratch


def test_paths_by_rows():
    assert [int4_path(r, 64, 256, CPU) for r in (1, 4, 8)] == [GEMV] * 3
    assert [int4_path(r, 64, 256, CPU) for r in (9, 16, 64, DEQUANT_ROWS - 1)] == \
        [TENSOR_CORE] * 4
    assert [int4_path(r, 64, 256, CPU) for r in (DEQUANT_ROWS, 1000)] == [DEQUANT] * 2


def test_tuning_table_entries():
    table = {"64x256": {"1": {"block_n": 4, "block_k": 128, "split_k": 2},
                        "8": TENSOR_CORE}}
    assert from_table(table, 1, 64, 256, 132) == Int4GemvConfig(4, 128, 2)
    assert from_table(table, 7, 64, 256, 132) is None  # bucket 8: the tensor-core kernel
    assert from_table(table, 2, 64, 256, 132) == heuristic_config(2, 64, 256, 132)


@pytest.mark.parametrize("rows", [3, 8, 20])
def test_three_paths_agree(rows):
    x, codes, packed, sz = operands(rows, 40, 256, 64, torch.float32, seed=3)
    outs = {path: int4_linear(x, packed, sz, 64, path) for path in (GEMV, TENSOR_CORE, DEQUANT)
            if path != GEMV or rows <= 8}
    for got in outs.values():
        assert_matches(got, x, codes, sz, 64)
        torch.testing.assert_close(got, outs[TENSOR_CORE], rtol=1e-5, atol=1e-5)
    assert int4_linear(x[:0], packed, sz, 64).shape == (0, 40)


def test_dequantize_in_row_chunks(monkeypatch):
    """The large-batch path's weight, a chunk of output rows at a time, is exactly W."""
    x, codes, packed, sz = operands(2, 72, 256, 32, torch.float32, seed=4)
    s, z = (sz[..., i].repeat_interleave(32, 0).t() for i in (0, 1))
    want = (codes.float() - 8) * s + z
    torch.testing.assert_close(dequantize_int4(packed, sz, 32, torch.float32), want,
                               rtol=0, atol=0)
    monkeypatch.setattr(int4_gemm, "DEQUANT_CHUNK_ELEMENTS", 16 * 256)  # 16 rows a chunk
    got = int4_linear(x, packed, sz, 32, DEQUANT)
    torch.testing.assert_close(got, x @ want.t(), rtol=1e-5, atol=1e-5)


def test_operands_checked():
    x, _, packed, sz = operands(2, 16, 128, 32, torch.float32)
    with pytest.raises(ValueError, match="groups"):
        int4_linear(x, packed, sz, 48)
    with pytest.raises(ValueError, match="scales_zeros"):
        int4_linear(x, packed, sz[:, :8], 32)
    with pytest.raises(ValueError, match="at most"):
        int4_gemv(torch.zeros(9, 128), packed, sz, 32)
