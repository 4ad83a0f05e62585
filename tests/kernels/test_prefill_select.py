"""Prefill attention's launch choice (tuning table, else the heuristic) and the kernel under a
launch other than the default, on the CPU interpreter."""
import os

# Must precede any triton import: the kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nanoserve.attention.metadata import AttentionMetadata  # noqa: E402
from nanoserve.attention.torch_backend import paged_attention_reference  # noqa: E402
from nanoserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from nanoserve.kernels import prefill_attention as prefill  # noqa: E402
from nanoserve.kernels.prefill_attention import (PrefillConfig, candidates,  # noqa: E402
                                                 from_table, heuristic_config, query_tile)

SHAPE = "32x8x128"  # heads x KV heads x head size
CUDA = torch.device("cuda")  # only a key here: select reads the table we patch in


def test_untuned_heads_launch_as_before_tables():
    """Without an entry: the launch the kernel had before tuning tables, bit for bit."""
    assert from_table({}, 32, 8, 128) == heuristic_config(128) == PrefillConfig(64, 64, 4, 3)
    assert from_table({}, 16, 8, 256) == PrefillConfig(64, 32, 4, 2)  # wide heads
    assert prefill.select(32, 8, 128, torch.device("cpu")) == prefill.INTERPRETER_CONFIG


def test_an_entry_applies_to_its_heads_only():
    entry = PrefillConfig(128, 32, 8, 2)
    table = {SHAPE: {"all": entry._asdict()}}
    assert from_table(table, 32, 8, 128) == entry
    assert from_table({SHAPE: {"all": {"block_n": 128}}}, 32, 8, 128) \
        == PrefillConfig(64, 128, 4, 3)  # a partial entry keeps the heuristic's other fields
    assert from_table(table, 32, 8, 64) == heuristic_config(64)  # another head size
    assert from_table(table, 32, 4, 128) == heuristic_config(128)  # another group
    assert from_table({SHAPE: {"other": entry._asdict()}}, 32, 8, 128) == heuristic_config(128)
    with pytest.raises(ValueError, match="block_q"):
        from_table({SHAPE: {"all": {"block_q": 4}}}, 32, 8, 128)


def test_the_runner_plans_with_the_tile_the_launch_takes(monkeypatch):
    table = {SHAPE: {"all": {"block_m": 128}}}
    monkeypatch.setattr(prefill, "load_table", lambda op, device: table)
    config = prefill.select(32, 8, 128, CUDA)
    assert config == PrefillConfig(128, 64, 4, 3)
    assert TritonAttentionBackend().prefill_tile(32, 8, 128, CUDA) \
        == query_tile(32, 8, config) == 128 // 4
    with pytest.raises(ValueError, match="head size"):
        prefill.work_on_device([3], [3], 32, 8, CUDA)  # on CUDA the launch's config is needed


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (16, 8, 256), (64, 2, 64)])
def test_candidates_are_few_distinct_and_hold_the_heuristic(heads, kv_heads, head_dim):
    found = candidates(heads, kv_heads, head_dim)
    assert 5 <= len(found) <= 20 and len(set(found)) == len(found)
    assert found[0] == heuristic_config(head_dim)
    group_rows = heads // kv_heads
    assert all(c.block_m >= min(group_rows, 32) and c.block_n >= 16 for c in found)


def _batch(seq_lens: list[int], q_lens: list[int], heads: int, kv_heads: int, head_dim: int,
           block_size: int = 16):
    """Random q and cache, each sequence's blocks taken in shuffled order."""
    gen = torch.Generator().manual_seed(sum(seq_lens))
    per_seq = [-(-n // block_size) for n in seq_lens]
    order = torch.randperm(sum(per_seq) + 2, generator=gen)
    tables = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32)
    first = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = order[first:first + n]
        first += n
    k_cache, v_cache = (torch.randn(len(order), block_size, kv_heads, head_dim, generator=gen)
                        for _ in range(2))
    q = 2 * torch.randn(sum(q_lens), heads, head_dim, generator=gen)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()],
                                     dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64),  # nothing is stored here
        block_tables=tables, max_query_len=max(q_lens), max_seq_len=max(seq_lens))
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("config", [PrefillConfig(32, 32, 4, 2), PrefillConfig(16, 64, 8, 1)])
def test_prefill_matches_reference_under_a_candidate(config):
    """A launch other than the interpreter's: the work list (here built by the kernel) and the
    launch take the same tile, whatever it is."""
    heads, kv_heads, head_dim = 8, 2, 32
    seq_lens, q_lens = [40, 9, 70], [13, 1, 70]  # chunked prefill, a decode, a prompt
    q, k_cache, v_cache, meta = _batch(seq_lens, q_lens, heads, kv_heads, head_dim)
    scale = head_dim ** -0.5
    out = prefill.prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, scale, config=config)
    work = prefill.work_on_device(q_lens, seq_lens, heads, kv_heads, q.device, config)
    assert torch.equal(prefill.prefill_attention(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
        work=work, config=config), out)
    expected = paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), meta,
                                         scale)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)
