"""The tensor-core int4 GEMM's launch choice (tuning table, else the heuristic) and the kernel
under launches other than the default, against float64 on the CPU interpreter."""
import os

# Must precede any triton import: the kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nanoserve.kernels import int4_gemm  # noqa: E402
from nanoserve.kernels.int4_gemm import (Int4GemmConfig, candidates,  # noqa: E402
                                         from_table, heuristic_config)
from test_int4_gemv import assert_matches, operands  # noqa: E402

SHAPE = "4096x4096,group=128"
SMS = 132


def test_untuned_shapes_launch_as_before_tables():
    """Without an entry: the launch the kernel had, 16-64 rows by 128 features, 4 warps, 3
    stages, K split in up to 4 where fewer programs than two an SM would run."""
    for rows, n, want in [(9, 4096, Int4GemmConfig(16, 128, 4, 4, 3)),
                          (40, 4096, Int4GemmConfig(64, 128, 4, 4, 3)),
                          (200, 24576, Int4GemmConfig(64, 128, 1, 4, 3)),
                          (100, 6144, Int4GemmConfig(64, 128, 3, 4, 3))]:
        assert heuristic_config(rows, n, 4096, 128, SMS) == want
        assert from_table({}, rows, n, 4096, 128, SMS) == want
    assert heuristic_config(20, 4096, 256, 128, SMS).split_k == 2  # no more slices than groups
    # The interpreter's: 32 features a program, one warp, one stage, its split for those.
    assert int4_gemm.select(20, 64, 256, 64, torch.device("cpu")) \
        == Int4GemmConfig(32, 32, 4, 1, 1)


def test_an_entry_applies_to_its_shape_and_row_bucket_only():
    entry = Int4GemmConfig(32, 64, 2, 4, 2)
    table = {SHAPE: {"32": entry._asdict()}}
    assert from_table(table, 32, 4096, 4096, 128, SMS) == entry
    assert from_table(table, 17, 4096, 4096, 128, SMS) == entry  # 17 to 32 rows share it
    assert from_table(table, 33, 4096, 4096, 128, SMS) \
        == heuristic_config(33, 4096, 4096, 128, SMS)
    assert from_table(table, 32, 4096, 4096, 64, SMS) \
        == heuristic_config(32, 4096, 4096, 64, SMS)  # another group size
    assert from_table(table, 32, 2048, 4096, 128, SMS) \
        == heuristic_config(32, 2048, 4096, 128, SMS)
    assert from_table({SHAPE: {"32": {"num_stages": 4}}}, 32, 4096, 4096, 128, SMS) \
        == heuristic_config(32, 4096, 4096, 128, SMS)._replace(num_stages=4)
    with pytest.raises(ValueError, match="block_k"):
        from_table({SHAPE: {"32": {"block_k": 64}}}, 32, 4096, 4096, 128, SMS)


def test_select_reads_the_int4_gemm_table(monkeypatch):
    tables = {"int4_gemm": {SHAPE: {"256": {"block_m": 128, "num_warps": 8}}}}
    monkeypatch.setattr(int4_gemm, "load_table", lambda op, device: tables[op])
    monkeypatch.setattr(int4_gemm, "device_sm_count", lambda device: SMS)
    cuda = torch.device("cuda")  # only a key here: select reads the table patched in
    assert int4_gemm.select(200, 4096, 4096, 128, cuda) \
        == heuristic_config(200, 4096, 4096, 128, SMS)._replace(block_m=128, num_warps=8)


@pytest.mark.parametrize("rows,n,k", [(9, 4096, 4096), (48, 24576, 4096), (200, 4096, 12288),
                                      (100, 64, 128)])
def test_candidates_are_few_distinct_and_hold_the_heuristic(rows, n, k):
    found = candidates(rows, n, k, 128, SMS)
    assert 4 <= len(found) <= 20 and len(set(found)) == len(found)
    assert found[0] == heuristic_config(rows, n, k, 128, SMS)
    for c in found[1:]:  # beside the heuristic's, none wider than the weight
        assert c.block_m in (16, 32, 64, 128) and c.block_n in (16, 32, 64, 128)
        assert c.block_n <= max(16, n) and 1 <= c.split_k <= k // 128
        assert c.num_warps == (8 if c.block_m * c.block_n >= 128 * 128 else 4)


@pytest.mark.parametrize("rows,config", [
    (20, Int4GemmConfig(16, 16, 3, 4, 2)),  # two row blocks, 3 slices of 4 groups: 2 of 2
    (40, Int4GemmConfig(64, 64, 1, 8, 3)),  # one row block, N not a multiple of the tile
    (9, Int4GemmConfig(32, 128, 4, 4, 3)),  # a tile wider than N, as many slices as groups
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int4_gemm_matches_float64_under_candidates(rows, config, dtype):
    x, codes, packed, sz = operands(rows, 72, 256, 64, dtype, seed=5)
    assert_matches(int4_gemm.int4_gemm(x, packed, sz, 64, config), x, codes, sz, 64)
