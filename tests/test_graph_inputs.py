"""The decode graphs' input arena (runner/graph_inputs.py), on the CPU: a staged step reads
back as the inputs the eager path prepares for the same chunks, padding and all."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from nanoserve.runner.cuda_graph import (SHORT_CONTEXT_MAX_BATCH, capture_sizes, context_caps,
                                         graph_key)
from nanoserve.runner.graph_inputs import GraphArena, decode_rows
from nanoserve.runner.inputs import PENDING_TOKEN, SequenceChunk
from nanoserve.runner.sampling_tensors import SamplingTensors, temperatures_only
from nanoserve.runner.step_inputs import prepare_inputs
from nanoserve.sampling_params import SamplingParams

BLOCK_SIZE = 4
MAX_BLOCKS = 6
SIZES = [1, 2, 4, 8]


def decode_step(seed: int, num_seqs: int) -> tuple[list[SequenceChunk], dict[str, int]]:
    """Chunks of one token each, some fed the previous step's sample (rows shuffled)."""
    rng = random.Random(seed)
    blocks = rng.sample(range(100), num_seqs * MAX_BLOCKS)
    chunks, last_rows = [], {}
    rows = rng.sample(range(8), num_seqs)
    for i in range(num_seqs):
        start = rng.randrange(MAX_BLOCKS * BLOCK_SIZE)
        table = blocks[i * MAX_BLOCKS:i * MAX_BLOCKS + start // BLOCK_SIZE + 1]
        pending = rng.random() < 0.6
        token = PENDING_TOKEN if pending else rng.randrange(1000)
        if pending:
            last_rows[f"r{i}"] = rows[i]
        chunks.append(SequenceChunk(f"r{i}", [token], start, table, True, SamplingParams(),
                                    [], [], []))
    return chunks, last_rows


@pytest.mark.parametrize("num_seqs,seed", [(1, 0), (3, 1), (4, 2), (7, 3)])
def test_staged_step_reads_as_the_eager_inputs(num_seqs, seed):
    chunks, last_rows = decode_step(seed, num_seqs)
    arena = GraphArena(SIZES, MAX_BLOCKS, max_samples=8, device=torch.device("cpu"))
    last_samples = torch.randint(0, 1000, (8,), generator=torch.Generator().manual_seed(seed))
    arena.samples.copy_(last_samples)
    temperature = np.linspace(0.0, 1.0, num_seqs, dtype=np.float32)
    bs = next(s for s in SIZES if s >= num_seqs)
    region = arena.stage(bs, decode_rows(chunks, BLOCK_SIZE, last_rows), temperature, 1234)

    ids, positions, meta, last = prepare_inputs(chunks, BLOCK_SIZE, torch.device("cpu"),
                                                last_samples, last_rows)
    n, width = num_seqs, meta.block_tables.shape[1]
    assert last is None and meta.decode_only
    assert torch.equal(arena.int64[region.sources][:n], ids)
    assert torch.equal(region.positions[:n], positions)
    assert torch.equal(region.slots[:n], meta.slot_mapping)
    assert torch.equal(region.seq_lens[:n], meta.seq_lens)
    assert torch.equal(region.order[:n], meta.seq_order)
    assert torch.equal(region.tables[:n, :width], meta.block_tables)
    assert region.tables.stride() == (1, bs)  # column-major: a step's columns are contiguous
    assert torch.equal(region.temperature[:n], torch.from_numpy(temperature))
    assert region.noise_seed.tolist() == [1234]
    # Padding rows: no slot, length 1 over block 0, greedy, in their own place, token 0.
    assert (region.slots[n:] == -1).all() and (region.seq_lens[n:] == 1).all()
    assert (region.tables[n:, 0] == 0).all() and (region.temperature[n:] == 0).all()
    assert region.order[n:].tolist() == list(range(n, bs))
    assert (arena.int64[region.sources][n:] == 0).all()


@pytest.mark.parametrize("windows", [(0, 5), (0, 5, 5)])
def test_staged_step_reads_as_the_eager_inputs_of_every_cache_group(windows):
    """Chunks carrying a table per cache group: each group's view of the region (tables
    strided through the shared columns, slots) reads as the eager metadata's view of that
    group, padding included; a sliding group's blocks before the window read as block 0."""
    num_seqs, bs, num_groups = 3, 4, len(windows)
    chunks, last_rows = decode_step(7, num_seqs)
    rng = random.Random(num_groups)
    for c in chunks:  # later groups' tables: other blocks, as many
        c.more_tables = [[rng.randrange(100, 200) for _ in c.block_table] for _ in windows[1:]]
    arena = GraphArena(SIZES, MAX_BLOCKS, max_samples=8, device=torch.device("cpu"),
                       num_groups=num_groups)
    last_samples = torch.arange(8) * 3
    arena.samples.copy_(last_samples)
    rows = decode_rows(chunks, BLOCK_SIZE, last_rows, windows)
    region = arena.stage(bs, rows, None, -1)
    _, _, meta, _ = prepare_inputs(chunks, BLOCK_SIZE, torch.device("cpu"), last_samples,
                                   last_rows, windows=windows)
    width = rows.tables.shape[1] // num_groups
    assert len(meta.groups) == len(region.group_tables) == num_groups
    for g, window in enumerate(windows):
        view = meta.group(g)
        assert torch.equal(region.group_tables[g][:num_seqs, :width], view.block_tables)
        assert torch.equal(region.group_slots[g][:num_seqs], view.slot_mapping)
        assert (region.group_slots[g][num_seqs:] == -1).all()
        assert (region.group_tables[g][num_seqs:, 0] == 0).all()
        for c, table, slot in zip(chunks, view.block_tables.tolist(), view.slot_mapping):
            own = c.more_tables[g - 1] if g else c.block_table
            first = max(0, c.start - window + 1) // BLOCK_SIZE if window else 0
            assert table[:len(own)] == [0] * first + own[first:]
            assert slot == own[c.start // BLOCK_SIZE] * BLOCK_SIZE + c.start % BLOCK_SIZE


def test_rows_go_longest_first_and_ties_keep_batch_order():
    lengths = [5, 9, 5, 12, 9, 5]
    chunks = [SequenceChunk(f"r{i}", [7], n - 1, [i], True, SamplingParams(), [], [], [])
              for i, n in enumerate(lengths)]
    rows = decode_rows(chunks, 16, {})
    assert rows.order.tolist() == [3, 1, 4, 0, 2, 5]
    assert rows.seq_lens.tolist() == lengths


def test_a_smaller_batch_pads_the_rows_a_larger_one_used():
    arena = GraphArena(SIZES, MAX_BLOCKS, max_samples=8, device=torch.device("cpu"))
    chunks, last_rows = decode_step(5, 4)
    arena.samples.fill_(7)
    arena.stage(4, decode_rows(chunks, BLOCK_SIZE, last_rows), None, -1)
    region = arena.stage(4, decode_rows(chunks[:3], BLOCK_SIZE, last_rows), None, -1)
    assert region.slots[3].item() == -1 and region.seq_lens[3].item() == 1
    assert region.tables[3, 0].item() == 0 and region.order[3].item() == 3
    assert region.noise_seed.item() == -1 and (region.temperature == 0).all()
    # Other sizes' regions are untouched by it.
    assert (arena.regions[8].slots == -1).all() and (arena.regions[8].seq_lens == 1).all()


def test_staging_copies_only_the_columns_a_step_uses():
    """A step's upload ends after the block-table columns it uses: stale columns past them are
    never read (each row reads the blocks its length covers)."""
    arena = GraphArena(SIZES, MAX_BLOCKS, max_samples=8, device=torch.device("cpu"))
    region = arena.regions[2]
    region.tables.fill_(99)
    chunks, last_rows = decode_step(6, 2)
    rows = decode_rows(chunks, BLOCK_SIZE, last_rows)
    arena.stage(2, rows, None, -1)
    width = rows.tables.shape[1]
    assert width < MAX_BLOCKS and (region.tables[:, width:] == 99).all()
    assert region.upload_bytes(width) < region.upload_bytes(MAX_BLOCKS)


def test_temperatures_only_agrees_with_the_sampling_tensors():
    """The graphs sample a batch themselves exactly when the sampler would take its fused
    path, with the temperatures it would use."""
    rng = random.Random(0)
    vocab = 50
    options = [dict(), dict(temperature=0.0), dict(temperature=0.7),
               dict(temperature=0.7, top_k=5), dict(temperature=0.0, top_k=5),
               dict(temperature=0.7, top_p=0.9), dict(temperature=0.0, min_p=0.1),
               dict(temperature=0.7, min_p=0.1), dict(repetition_penalty=1.2),
               dict(temperature=0.0, presence_penalty=0.5), dict(logit_bias={3: 1.0}),
               dict(allowed_token_ids=[1, 2]), dict(temperature=0.7, seed=3),
               dict(temperature=0.0, seed=3), dict(temperature=0.7, top_k=vocab + 10)]
    for trial in range(200):
        picks = [rng.choice(options) for _ in range(rng.randint(1, 4))]
        params = [SamplingParams(**p) for p in picks]
        banned = [rng.choice([[], [], [vocab + 1], [2]]) for _ in params]
        generators = [torch.Generator() if p.seed is not None else None for p in params]
        temperature = temperatures_only(params, banned, generators, vocab)
        tensors = SamplingTensors.build(params, [[1]] * len(params), [[2]] * len(params),
                                        banned, generators, vocab, torch.device("cpu"))
        assert (temperature is not None) == tensors.only_temperature, picks
        if temperature is not None:
            assert torch.equal(torch.from_numpy(temperature), tensors.temperature)


def test_small_batches_pick_the_graph_of_the_shortest_cap_that_fits():
    sizes, max_len = capture_sizes(64), 40960
    assert context_caps(1, max_len) == [512, 2048, 8192, 32768, max_len]
    assert context_caps(SHORT_CONTEXT_MAX_BATCH, 8192) == [512, 2048, 8192]
    assert context_caps(SHORT_CONTEXT_MAX_BATCH + 1, max_len) == [max_len]
    assert context_caps(1, 1000) == [512, 1000]
    assert context_caps(1, 300) == [300]
    assert graph_key(sizes, max_len, 1, 1) == (1, 512)
    assert graph_key(sizes, max_len, 1, 512) == (1, 512)  # the new token included
    assert graph_key(sizes, max_len, 1, 513) == (1, 2048)
    assert graph_key(sizes, max_len, 3, 2049) == (4, 8192)
    assert graph_key(sizes, max_len, 8, 32769) == (8, max_len)
    assert graph_key(sizes, max_len, 9, 10) == (16, max_len)  # a large batch: one graph
    # Every key names a graph that is captured.
    captured = {(bs, cap) for bs in sizes for cap in context_caps(bs, max_len)}
    assert all(graph_key(sizes, max_len, n, length) in captured
               for n in range(1, 65) for length in (1, 511, 512, 513, 2049, max_len))
