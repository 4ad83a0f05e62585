"""The PyTorch attention backend against attention written out per sequence and head: keys read
in place (one sequence on consecutive blocks) or gathered, masks dropped where every key is
seen, the plan made once per forward and shared by the layers."""
import math

import pytest
import torch

from nanoserve.attention.metadata import AttentionMetadata
from nanoserve.attention.torch_backend import TorchAttentionBackend, paged_attention_reference
from nanoserve.attention.torch_plan import plan_attention

BLOCK, HEADS, KV_HEADS, DIM = 4, 4, 2, 8


def batch(seq_lens: list[int], q_lens: list[int], consecutive: bool, seed: int = 0):
    """q and a float64 paged cache; each sequence's blocks consecutive, or shuffled."""
    gen = torch.Generator().manual_seed(seed)
    counts = [math.ceil(n / BLOCK) for n in seq_lens]
    num_blocks = sum(counts) + 2
    order = list(range(1, num_blocks)) if consecutive else \
        (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seq_lens), max(counts) + 1, dtype=torch.int32)
    slots = []
    for i, (n, q) in enumerate(zip(seq_lens, q_lens)):
        ids, order = order[:counts[i]], order[counts[i]:]
        tables[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        slots += [ids[p // BLOCK] * BLOCK + p % BLOCK for p in range(n - q, n)]
    shape = (num_blocks, BLOCK, KV_HEADS, DIM)
    k_cache = torch.randn(shape, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(shape, generator=gen, dtype=torch.float64)
    q = torch.randn(sum(q_lens), HEADS, DIM, generator=gen, dtype=torch.float64)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(torch.tensor(starts, dtype=torch.int32),
                             torch.tensor(seq_lens, dtype=torch.int32),
                             torch.tensor(slots, dtype=torch.int64), tables,
                             max(q_lens), max(seq_lens))
    return q, k_cache, v_cache, meta


def naive(q, k_cache, v_cache, meta, scale, window=0, softcap=0.0):
    out = torch.zeros_like(q)
    starts = meta.query_start_loc.tolist()
    for i, n in enumerate(meta.seq_lens.tolist()):
        rows = torch.arange(n)
        blocks = meta.block_tables[i].long()[rows // BLOCK]
        keys, values = k_cache[blocks, rows % BLOCK], v_cache[blocks, rows % BLOCK]
        for t in range(starts[i], starts[i + 1]):
            pos = n - (starts[i + 1] - t)
            seen = (rows <= pos) & ((rows > pos - window) if window else True)
            for h in range(HEADS):
                kv = h // (HEADS // KV_HEADS)
                s = keys[seen, kv] @ q[t, h] * scale
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                out[t, h] = torch.softmax(s, 0) @ values[seen, kv]
    return out


@pytest.mark.parametrize("seq_lens,q_lens", [([13], [1]), ([13], [5]), ([9], [9]),
                                             ([13, 7, 30], [1, 1, 1]), ([13, 7, 30], [1, 3, 1]),
                                             ([12, 12], [1, 1])])
@pytest.mark.parametrize("consecutive", [True, False])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (3, 0.0), (0, 5.0)])
def test_matches_attention_per_sequence(seq_lens, q_lens, consecutive, window, softcap):
    q, k_cache, v_cache, meta = batch(seq_lens, q_lens, consecutive)
    got = paged_attention_reference(q, k_cache, v_cache, meta, 0.3, window, softcap)
    torch.testing.assert_close(got, naive(q, k_cache, v_cache, meta, 0.3, window, softcap))


@pytest.mark.parametrize("consecutive", [True, False])
def test_blocks_before_every_window_are_not_read(consecutive):
    """Gathered or in place, keys wholly before each query's window are skipped: blocks the
    scheduler freed (placeholders, here NaN) never reach the output."""
    q, k_cache, v_cache, meta = batch([30, 25, 29], [1, 2, 1], consecutive, seed=5)
    window = 6
    want = naive(q, k_cache, v_cache, meta, 0.3, window)
    first = (min(n - q_len for n, q_len in ((30, 1), (25, 2), (29, 1))) + 1 - window) // BLOCK
    for row in meta.block_tables:
        k_cache[row[:first].long()] = float("nan")
        v_cache[row[:first].long()] = float("nan")
    got = paged_attention_reference(q, k_cache, v_cache, meta, 0.3, window)
    torch.testing.assert_close(got, want)


def test_plan_reads_one_sequence_in_place_and_drops_full_masks():
    q, k_cache, v_cache, meta = batch([13], [1], consecutive=True)
    (group,) = plan_attention(meta, BLOCK).groups
    assert group.blocks is None and group.tokens is None
    assert group.visibility(0) == (0, None)  # a decode step's query sees every key
    start, mask = group.visibility(3)
    assert start == 10 and mask is None  # only the window's keys are read
    keys = group.keys(k_cache, 0, torch.float64)
    assert keys.data_ptr() == k_cache[meta.block_tables[0, 0]].data_ptr()  # a view

    _, _, _, shuffled = batch([13], [1], consecutive=False, seed=3)
    assert plan_attention(shuffled, BLOCK).groups[0].blocks is not None
    _, _, _, prefill = batch([13], [5], consecutive=True)
    assert plan_attention(prefill, BLOCK).groups[0].visibility(0)[1] is not None  # causal


def test_backend_plans_once_per_forward_and_stores_valid_slots():
    q, k_cache, v_cache, meta = batch([13, 7], [1, 1], consecutive=False)
    backend = TorchAttentionBackend()
    first = backend.plan(meta, BLOCK)
    assert backend.plan(meta, BLOCK) is first
    later = AttentionMetadata(meta.query_start_loc, meta.seq_lens, meta.slot_mapping,
                              meta.block_tables, meta.max_query_len, meta.max_seq_len)
    assert backend.plan(later, BLOCK) is not first

    k = torch.randn(2, KV_HEADS, DIM, dtype=torch.float64)
    v = torch.randn(2, KV_HEADS, DIM, dtype=torch.float64)
    padded = torch.tensor([meta.slot_mapping[0].item(), -1])
    before = k_cache.clone()
    backend.store_kv(k, v, k_cache, v_cache, padded)
    flat = k_cache.view(-1, KV_HEADS, DIM)
    torch.testing.assert_close(flat[padded[0]], k[0], rtol=0, atol=0)
    changed = (k_cache != before).any(-1).any(-1).nonzero()
    assert len(changed) == 1  # the -1 slot stored nothing
