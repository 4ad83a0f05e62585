"""MLA decode's launch choice: a tuning table's entry, else the heuristic (the kernel under
other launches: test_mla_decode.py)."""
import os

# Must precede any triton import: the kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nanoserve.kernels import mla_decode as mla  # noqa: E402
from nanoserve.kernels.decode_attention import MAX_SPLITS, clamped_splits  # noqa: E402
from nanoserve.kernels.mla_decode import (MlaDecodeConfig, candidates,  # noqa: E402
                                          from_table, heuristic_config)

SHAPE = "16x512x64"  # DeepSeek-V2-Lite: 16 heads, latent 512, rope 64
SMS = 132


def test_untuned_shapes_launch_as_before_tables():
    """Without an entry: the constants the kernel had (16 heads a program, 32 keys a tile, 8
    warps, Triton's 3 stages) and num_decode_splits' count for blocks of 16 heads."""
    for seqs, heads, context, splits in [(1, 16, 2048, 32), (64, 128, 8192, 4),
                                         (256, 16, 512, 8), (8, 16, 40, 1)]:
        want = MlaDecodeConfig(splits, 16, 32, 8, 3)
        assert heuristic_config(seqs, heads, context, SMS) == want
        assert from_table({}, seqs, heads, 512, 64, context, SMS) == want
    assert mla.select(4, 16, 24, 8, 100, torch.device("cpu")) == MlaDecodeConfig(
        heuristic_config(4, 16, 100, 4).num_splits, 16, 16, 1, 3)  # the interpreter's tiles


def test_an_entry_applies_to_its_shape_and_bucket_only():
    entry = MlaDecodeConfig(4, 32, 64, 8, 2)
    table = {SHAPE: {"8x2048": entry._asdict()}}
    assert from_table(table, 8, 16, 512, 64, 2048, SMS) == entry
    assert from_table(table, 5, 16, 512, 64, 600, SMS) == entry  # same batch and context bucket
    assert from_table(table, 9, 16, 512, 64, 2048, SMS) == heuristic_config(9, 16, 2048, SMS)
    assert from_table(table, 8, 16, 512, 64, 4096, SMS) == heuristic_config(8, 16, 4096, SMS)
    assert from_table(table, 8, 32, 512, 64, 2048, SMS) == heuristic_config(8, 32, 2048, SMS)
    partial = {SHAPE: {"8x2048": {"block_n": 16}}}
    assert from_table(partial, 8, 16, 512, 64, 2048, SMS) \
        == heuristic_config(8, 16, 2048, SMS)._replace(block_n=16)
    with pytest.raises(ValueError, match="block_h"):
        from_table({SHAPE: {"8x2048": {"block_h": 32}}}, 8, 16, 512, 64, 2048, SMS)


def test_a_tuned_split_count_stays_within_the_context():
    table = {SHAPE: {"1x512": {"num_splits": 64}}}
    most = clamped_splits(MAX_SPLITS, 300)
    assert from_table(table, 1, 16, 512, 64, 300, SMS).num_splits == most == 4


def test_select_reads_the_mla_decode_table(monkeypatch):
    tables = {"mla_decode": {SHAPE: {"1x512": {"num_warps": 4}}}}
    monkeypatch.setattr(mla, "load_table", lambda op, device: tables[op])
    monkeypatch.setattr(mla, "device_sm_count", lambda device: SMS)
    cuda = torch.device("cuda")  # only a key here: select reads the table patched in
    assert mla.select(1, 16, 512, 64, 512, cuda) \
        == heuristic_config(1, 16, 512, SMS)._replace(num_warps=4)


@pytest.mark.parametrize("seqs,heads,context", [(1, 16, 8192), (64, 128, 2048), (4, 16, 64)])
def test_candidates_are_few_distinct_and_hold_the_heuristic(seqs, heads, context):
    found = candidates(seqs, heads, context, SMS)
    assert 4 <= len(found) <= 20 and len(set(found)) == len(found)
    assert found[0] == heuristic_config(seqs, heads, context, SMS)
    for c in found:
        assert c.heads_per_program in (16, 32)
        assert 1 <= c.num_splits <= clamped_splits(MAX_SPLITS, context)
        assert c.heads_per_program == 16 or heads > 16
