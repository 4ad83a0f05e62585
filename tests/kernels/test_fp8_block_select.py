"""The block-fp8 GEMM's launch choice: a tuning table's entry, else the heuristic (the kernel
under other launches: test_fp8_block_gemm.py)."""
import os

# Must precede any triton import: the kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nanoserve.kernels import fp8_block_gemm  # noqa: E402
from nanoserve.kernels.fp8_block_gemm import (Fp8BlockConfig, candidates,  # noqa: E402
                                              from_table, heuristic_config)

SHAPE = "4096x4096,block=128x128"
BLOCK = (128, 128)


def test_untuned_shapes_launch_as_before_tables():
    """Without an entry: the launch the kernel had, 16 rows a block up to 16 rows, else 64, by
    a scale block's features up to 128, Triton's 4 warps and 3 stages."""
    for rows, block, want in [(1, BLOCK, Fp8BlockConfig(16, 128, 4, 3)),
                              (16, BLOCK, Fp8BlockConfig(16, 128, 4, 3)),
                              (17, BLOCK, Fp8BlockConfig(64, 128, 4, 3)),
                              (4096, (64, 128), Fp8BlockConfig(64, 64, 4, 3)),
                              (8, (256, 128), Fp8BlockConfig(16, 128, 4, 3))]:
        assert heuristic_config(rows, block[0]) == want
        assert from_table({}, rows, 4096, 4096, block) == want
    # The interpreter's: 32 features a program at most.
    assert fp8_block_gemm.select(20, 64, 64, (64, 32), torch.device("cpu")) \
        == Fp8BlockConfig(64, 32, 4, 3)
    assert fp8_block_gemm.select(2, 64, 64, (16, 32), torch.device("cpu")) \
        == Fp8BlockConfig(16, 16, 4, 3)


def test_an_entry_applies_to_its_shape_and_row_bucket_only():
    entry = Fp8BlockConfig(32, 256, 8, 4)
    table = {SHAPE: {"32": entry._asdict()}}
    assert from_table(table, 32, 4096, 4096, BLOCK) == entry
    assert from_table(table, 17, 4096, 4096, BLOCK) == entry  # 17 to 32 rows share it
    assert from_table(table, 16, 4096, 4096, BLOCK) == heuristic_config(16, 128)
    assert from_table(table, 32, 4096, 4096, (64, 128)) == heuristic_config(32, 64)
    assert from_table(table, 32, 2048, 4096, BLOCK) == heuristic_config(32, 128)
    assert from_table({SHAPE: {"32": {"num_warps": 8}}}, 32, 4096, 4096, BLOCK) \
        == heuristic_config(32, 128)._replace(num_warps=8)
    with pytest.raises(ValueError, match="block_k"):
        from_table({SHAPE: {"32": {"block_k": 64}}}, 32, 4096, 4096, BLOCK)


def test_select_reads_the_fp8_block_gemm_table(monkeypatch):
    tables = {"fp8_block_gemm": {SHAPE: {"4096": {"block_m": 128}}}}
    monkeypatch.setattr(fp8_block_gemm, "load_table", lambda op, device: tables[op])
    cuda = torch.device("cuda")  # only a key here: select reads the table patched in
    assert fp8_block_gemm.select(8192, 4096, 4096, BLOCK, cuda) == Fp8BlockConfig(128, 128)


@pytest.mark.parametrize("rows,n", [(1, 4096), (24, 24576), (100, 4096), (4096, 4096),
                                    (64, 48)])
def test_candidates_are_few_distinct_and_hold_the_heuristic(rows, n):
    found = candidates(rows, n, BLOCK)
    assert 4 <= len(found) <= 20 and len(set(found)) == len(found)
    assert found[0] == heuristic_config(rows, 128)
    for c in found[1:]:  # beside the heuristic's, none wider than the weight
        assert c.block_m in (16, 32, 64, 128) and c.block_n in (16, 32, 64, 128, 256)
        assert c.block_m <= max(16, 2 * rows) and c.block_n <= max(16, 2 * n)
