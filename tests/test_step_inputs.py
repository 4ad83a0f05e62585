"""A step's chunks as model inputs: the packed host-to-device copy and the attention metadata."""
import numpy as np
import torch

from nanoserve.attention.prefill_work import prefill_work
from nanoserve.runner.inputs import PENDING_TOKEN, SequenceChunk
from nanoserve.runner.packed_copy import TENSOR_ALIGNMENT, packed_to_device
from nanoserve.runner.step_inputs import prepare_inputs
from nanoserve.sampling_params import SamplingParams

BLOCK = 4


def chunk(rid: str, tokens: list[int], start: int, table: list[int], sample: bool = True
          ) -> SequenceChunk:
    return SequenceChunk(rid, tokens, start, table, sample, SamplingParams(), [], [], [])


def test_packed_views_keep_values_dtypes_and_alignment():
    parts = [([1, -2, 3], np.int64), ([], np.int64), ([7], np.int32), ([0.5, -1.25], np.float32),
             ([2 ** 40], np.int64), (list(range(9)), np.int32)]
    tensors = packed_to_device(parts, torch.device("cpu"))
    base = tensors[0].untyped_storage().data_ptr()
    for (values, dtype), t in zip(parts, tensors):
        assert t.dtype == {np.int64: torch.int64, np.int32: torch.int32,
                           np.float32: torch.float32}[dtype]
        assert t.tolist() == values
        assert (t.data_ptr() - base) % TENSOR_ALIGNMENT == 0


def test_decode_step_slots_order_and_no_gather():
    # Three decoding sequences: slots found on the host, longest context first, every row sampled.
    chunks = [chunk("a", [11], 5, [3, 9]), chunk("b", [12], 0, [4]),
              chunk("c", [13], 9, [0, 1, 2])]
    ids, positions, meta, last = prepare_inputs(chunks, BLOCK, torch.device("cpu"), None, {})
    assert ids.tolist() == [11, 12, 13] and positions.tolist() == [5, 0, 9]
    assert meta.slot_mapping.tolist() == [9 * BLOCK + 1, 4 * BLOCK + 0, 2 * BLOCK + 1]
    assert meta.seq_lens.tolist() == [6, 1, 10] and meta.seq_order.tolist() == [2, 0, 1]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3]
    assert meta.block_tables.tolist() == [[3, 9, 0], [4, 0, 0], [0, 1, 2]]
    assert meta.block_tables.dtype == meta.seq_lens.dtype == torch.int32
    assert last is None


def test_mixed_step_gathers_sampled_rows_and_fills_pending_tokens():
    # A prefill chunk that does not sample yet beside a decode whose token is still on the device.
    chunks = [chunk("p", [5, 6, 7], 2, [8, 5], sample=False),
              chunk("d", [PENDING_TOKEN], 3, [6])]
    last_samples = torch.tensor([40, 41])
    ids, positions, meta, last = prepare_inputs(chunks, BLOCK, torch.device("cpu"),
                                                last_samples, {"d": 1})
    assert ids.tolist() == [5, 6, 7, 41] and positions.tolist() == [2, 3, 4, 3]
    assert meta.slot_mapping.tolist() == [8 * BLOCK + 2, 8 * BLOCK + 3, 5 * BLOCK + 0,
                                          6 * BLOCK + 3]
    assert meta.query_start_loc.tolist() == [0, 3, 4] and meta.seq_order is None
    assert last.tolist() == [3]


def test_steady_decode_takes_the_previous_samples_as_they_are():
    # Every token is pending and the rows line up with the previous step's: no gather needed.
    chunks = [chunk("a", [PENDING_TOKEN], 5, [3, 9]), chunk("b", [PENDING_TOKEN], 0, [4])]
    last_samples = torch.tensor([70, 71, 72])  # the third request has finished
    ids, _, _, _ = prepare_inputs(chunks, BLOCK, torch.device("cpu"), last_samples,
                                  {"a": 0, "b": 1})
    assert ids.tolist() == [70, 71]
    ids, _, _, _ = prepare_inputs(chunks, BLOCK, torch.device("cpu"), last_samples,
                                  {"a": 1, "b": 0})  # rows swapped: gathered
    assert ids.tolist() == [71, 70]


def test_prefill_work_lists_every_tile_once_most_keys_first():
    # A decode, a whole prompt, a short prompt and a chunk after a cached prefix, 16-token tiles.
    q_lens, seq_lens = [1, 70, 9, 33], [50, 70, 9, 40]
    work = prefill_work(q_lens, seq_lens, 16)
    assert work.dtype == np.int32 and work.shape[0] == 2
    pairs = list(zip(*work.tolist()))
    assert sorted(pairs) == [(s, t) for s, n in enumerate(q_lens) for t in range(-(-n // 16))]
    # A tile reads its sequence's keys up to its last token: most first, ties in batch order.
    keys = [min(seq_lens[s], seq_lens[s] - q_lens[s] + (t + 1) * 16) for s, t in pairs]
    assert keys == sorted(keys, reverse=True)
    assert pairs[:3] == [(1, 4), (1, 3), (0, 0)]  # 70, 64 and 50 keys
    assert prefill_work([], [], 16).shape == (2, 0)


def test_steps_carry_the_prefill_work_list_when_the_backend_wants_one():
    chunks = [chunk("p", [5, 6, 7], 2, [8, 5], sample=False), chunk("d", [PENDING_TOKEN], 3, [6])]
    last_samples = torch.tensor([40, 41])
    _, _, meta, _ = prepare_inputs(chunks, BLOCK, torch.device("cpu"), last_samples, {"d": 1},
                                   prefill_tile=2)
    assert meta.prefill_work.dtype == torch.int32
    assert meta.prefill_work.tolist() == prefill_work([3, 1], [5, 4], 2).tolist()
    _, _, meta, _ = prepare_inputs(chunks, BLOCK, torch.device("cpu"), last_samples, {"d": 1})
    assert meta.prefill_work is None  # a backend without a work list (prefill_tile 0)
    decodes = [chunk("a", [11], 5, [3, 9]), chunk("b", [12], 0, [4])]
    _, _, meta, _ = prepare_inputs(decodes, BLOCK, torch.device("cpu"), None, {}, prefill_tile=2)
    assert meta.prefill_work is None  # decode kernels take sequences through seq_order
