"""Triton decode and prefill kernels against the PyTorch reference, on the CPU interpreter."""
import os

# Must precede any triton import: the kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nanoserve.attention.metadata import AttentionMetadata  # noqa: E402
from nanoserve.attention.torch_backend import (  # noqa: E402
    TorchAttentionBackend,
    paged_attention_reference,
)
from nanoserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from nanoserve.kernels.decode_attention import (  # noqa: E402
    BALANCE_TARGET,
    MAX_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    ONE_TILE_SPLIT_TUNING,
    PROGRAMS_PER_SM,
    SPLIT_DECODE_TUNING,
    DecodeTuning,
    NewTokens,
    decode_attention,
    num_decode_splits,
    split_decode_tuning,
)
from nanoserve.kernels.decode_attention import candidates as decode_candidates  # noqa: E402
from nanoserve.kernels.tuning import clear_caches  # noqa: E402
from nanoserve.kernels.decode_attention import from_table as decode_select_from_table  # noqa: E402
from nanoserve.kernels.decode_attention import shape_key as decode_shape_key  # noqa: E402
from nanoserve.kernels.prefill_attention import prefill_attention, work_on_device  # noqa: E402
from nanoserve.layers.norm import RMSNorm  # noqa: E402
from nanoserve.layers.rotary import RotaryEmbedding  # noqa: E402

TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=3e-3)}
GARBAGE = 1e3  # cache slots no sequence owns: a kernel reading them gets far off the reference


def make_batch(seq_lens: list[int], q_lens: list[int], *, num_heads: int, num_kv_heads: int,
               head_dim: int, block_size: int, dtype: torch.dtype = torch.float32,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random q and a random paged cache whose blocks are handed out in shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay garbage
    order = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq, default=0) + 1  # one column of table padding
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, GARBAGE)
    v_cache = torch.full(shape, GARBAGE)
    slots = []
    for i, (n, q_len) in enumerate(zip(seq_lens, q_lens)):
        ids = order[:blocks_per_seq[i]]
        order = order[blocks_per_seq[i]:]
        block_tables[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        for pos in range(n):
            block, offset = ids[pos // block_size], pos % block_size
            k_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen)
            v_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen)
            if pos >= n - q_len:
                slots.append(block * block_size + offset)
        slots += [-1] * max(q_len - n, 0)  # a padding sequence with no context owns no slot
    # Scaled queries give peaked softmaxes, which exercise the running-max rescaling.
    q = 2 * torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=block_tables,
        max_query_len=max(q_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
    )
    return q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), meta


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              meta: AttentionMetadata) -> torch.Tensor:
    return paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), meta,
                                     q.shape[-1] ** -0.5)


def assert_matches_reference(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, meta),
                               **TOLERANCE[q.dtype])


def run_decode(q, k_cache, v_cache, meta, num_splits=None, tuning=DecodeTuning()):
    return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                            meta.query_start_loc, meta.max_seq_len, q.shape[-1] ** -0.5,
                            num_splits=num_splits, tuning=tuning)


def run_prefill(q, k_cache, v_cache, meta):
    return prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                             meta.query_start_loc, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("group,head_dim,block_size,num_splits", [
    (1, 64, 16, 1),
    (2, 128, 16, 3),
    (4, 64, 32, 2),
    (8, 128, 16, 1),
    (8, 64, 64, 4),
    (2, 64, 256, 2),
])
@pytest.mark.parametrize("heads_first", [False, True], ids=["seqs-first", "heads-first"])
@pytest.mark.parametrize("narrow_offsets", [False, True], ids=["int64", "int32"])
def test_decode_matches_reference(group, head_dim, block_size, num_splits, heads_first,
                                  narrow_offsets):
    seq_lens = [37, 1, 70, 16]  # ragged, one-token, multi-block and exactly-full-block contexts
    q, k_cache, v_cache, meta = make_batch(seq_lens, [1] * 4, num_heads=2 * group, num_kv_heads=2,
                                           head_dim=head_dim, block_size=block_size)
    tuning = DecodeTuning(heads_first=heads_first, narrow_offsets=narrow_offsets)
    out = run_decode(q, k_cache, v_cache, meta, num_splits, tuning)
    assert_matches_reference(out, q, k_cache, v_cache, meta)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("heads_first", [False, True], ids=["seqs-first", "heads-first"])
def test_decode_in_longest_first_order(num_splits, heads_first):
    # Programs take sequences through seq_order: every sequence's output still lands in its own
    # rows, whatever permutation the order is (the engine passes longest context first).
    seq_lens = [37, 1, 70, 16, 0]
    q, k_cache, v_cache, meta = make_batch(seq_lens, [1] * 5, num_heads=4, num_kv_heads=2,
                                           head_dim=64, block_size=16)
    for order in ([2, 0, 3, 1, 4], [4, 3, 2, 1, 0]):
        out = decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                               meta.query_start_loc, meta.max_seq_len, 64 ** -0.5,
                               num_splits=num_splits, tuning=DecodeTuning(heads_first=heads_first),
                               seq_order=torch.tensor(order, dtype=torch.int32))
        assert_matches_reference(out, q, k_cache, v_cache, meta)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_reads_a_column_major_block_table(num_splits):
    """The decode graphs keep their block table column-major ([max_blocks, batch] storage, so a
    step uploads only the columns it uses), with spare columns past the step's width."""
    seq_lens = [37, 1, 70, 16]
    q, k_cache, v_cache, meta = make_batch(seq_lens, [1] * 4, num_heads=4, num_kv_heads=2,
                                           head_dim=64, block_size=16)
    storage = torch.full((meta.block_tables.shape[1] + 3, 6), 10 ** 6, dtype=torch.int32)
    storage[:meta.block_tables.shape[1], :4] = meta.block_tables.T
    tables = storage[:, :4].T  # [4, width + 3] with strides (1, 6)
    assert tables.stride() == (1, 6)
    out = decode_attention(q, k_cache, v_cache, tables, meta.seq_lens, meta.query_start_loc,
                           meta.max_seq_len, 64 ** -0.5, num_splits=num_splits)
    assert_matches_reference(out, q, k_cache, v_cache, meta)


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """``cache``'s values, stored ``[blocks, Hkv, block_size, D]`` and viewed with its shape."""
    blocks, block_size, heads, dim = cache.shape
    copy = torch.empty(blocks, heads, block_size, dim, dtype=cache.dtype).transpose(1, 2)
    copy.copy_(cache)
    assert not copy.is_contiguous()
    return copy


@pytest.mark.parametrize("num_splits", [1, 3])
def test_kernels_take_any_cache_strides(num_splits):
    """The kernels address the caches through their strides (``decode_workload.py
    --head-major`` relies on it): over caches stored head-major, decode, split decode storing
    the new tokens, and prefill give exactly what they give over the engine's layout."""
    seq_lens = [37, 1, 70, 16]
    q, k_cache, v_cache, meta = make_batch(seq_lens, [1] * 4, num_heads=4, num_kv_heads=2,
                                           head_dim=32, block_size=16)
    out = run_decode(q, head_major(k_cache), head_major(v_cache), meta, num_splits)
    assert torch.equal(out, run_decode(q, k_cache, v_cache, meta, num_splits))
    assert_matches_reference(out, q, k_cache, v_cache, meta)

    k, v, positions, rotary, _ = new_token_inputs(q, 2, meta, False, seed=1)
    caches = {"engine": (k_cache.clone(), v_cache.clone()),
              "head-major": (head_major(k_cache), head_major(v_cache))}
    outs = {name: decode_attention(q, *c, meta.block_tables, meta.seq_lens,
                                   meta.query_start_loc, meta.max_seq_len, 32 ** -0.5,
                                   num_splits=num_splits,
                                   new_tokens=NewTokens(k, v, positions, meta.slot_mapping,
                                                        rotary.cos_sin))
            for name, c in caches.items()}
    assert torch.equal(outs["head-major"], outs["engine"])
    for mine, theirs in zip(caches["head-major"], caches["engine"]):
        assert torch.equal(mine, theirs)  # the new keys and values went to the same slots

    q, k_cache, v_cache, meta = make_batch([45, 23], [13, 23], num_heads=4, num_kv_heads=2,
                                           head_dim=32, block_size=16)
    out = run_prefill(q, head_major(k_cache), head_major(v_cache), meta)
    assert torch.equal(out, run_prefill(q, k_cache, v_cache, meta))


def test_decode_more_splits_than_tiles_and_empty_sequences():
    # Splits beyond a sequence's tile count stay empty; seq_len 0 (graph padding) gives zeros.
    q, k_cache, v_cache, meta = make_batch([5, 0, 40], [1, 1, 1], num_heads=4, num_kv_heads=2,
                                           head_dim=32, block_size=16)
    for num_splits in (1, 6):
        out = run_decode(q, k_cache, v_cache, meta, num_splits)
        assert_matches_reference(out, q, k_cache, v_cache, meta)
        assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("group,head_dim,block_size,seq_lens,q_lens", [
    (1, 64, 16, [19, 40], [19, 40]),  # plain prefill
    (2, 128, 16, [45, 23], [13, 23]),  # chunked prefill: a cached prefix, then a chunk
    (4, 64, 32, [50, 9, 33, 17], [1, 9, 1, 6]),  # mixed: decodes beside prefills
    (8, 128, 16, [30, 1], [12, 1]),
    (2, 64, 256, [40, 3], [21, 2]),
])
def test_prefill_matches_reference(group, head_dim, block_size, seq_lens, q_lens):
    q, k_cache, v_cache, meta = make_batch(seq_lens, q_lens, num_heads=2 * group, num_kv_heads=2,
                                           head_dim=head_dim, block_size=block_size)
    out = run_prefill(q, k_cache, v_cache, meta)
    assert_matches_reference(out, q, k_cache, v_cache, meta)


@pytest.mark.parametrize("group", [1, 2, 8])
def test_prefill_takes_its_programs_from_the_work_list_in_any_order(group):
    # The runner's list (most keys first), its reverse and a shuffle: each (sequence, tile)
    # program writes its own rows, whatever order the programs run in.
    seq_lens, q_lens = [50, 9, 33, 17, 70], [1, 9, 1, 6, 70]
    q, k_cache, v_cache, meta = make_batch(seq_lens, q_lens, num_heads=2 * group,
                                           num_kv_heads=2, head_dim=32, block_size=16)
    work = work_on_device(q_lens, seq_lens, 2 * group, 2, q.device)
    shuffled = torch.randperm(work.shape[1], generator=torch.Generator().manual_seed(0))
    for items in (work, work.flip(1).contiguous(), work[:, shuffled].contiguous()):
        out = prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                meta.query_start_loc, 32 ** -0.5, work=items)
        assert_matches_reference(out, q, k_cache, v_cache, meta)


@pytest.mark.parametrize("head_dim", [24, 80])
def test_non_power_of_two_head_dim(head_dim):
    q, k_cache, v_cache, meta = make_batch([20, 35], [20, 1], num_heads=4, num_kv_heads=2,
                                           head_dim=head_dim, block_size=16)
    assert_matches_reference(run_prefill(q, k_cache, v_cache, meta), q, k_cache, v_cache, meta)
    q, k_cache, v_cache, meta = make_batch([20, 35], [1, 1], num_heads=4, num_kv_heads=2,
                                           head_dim=head_dim, block_size=16)
    assert_matches_reference(run_decode(q, k_cache, v_cache, meta, num_splits=2),
                             q, k_cache, v_cache, meta)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("q_lens", [[1, 1, 1], [1, 12, 1]], ids=["decode", "mixed"])
def test_backend_attends_new_keys_like_torch_backend(dtype, q_lens):
    seq_lens = [29, 12, 51]
    q, k_cache, v_cache, meta = make_batch(seq_lens, q_lens, num_heads=8, num_kv_heads=2,
                                           head_dim=32, block_size=16, dtype=dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    new_k = torch.randn(q.shape[0], 2, 32, generator=gen).to(dtype)
    new_v = torch.randn(q.shape[0], 2, 32, generator=gen).to(dtype)
    # The Triton backend stores inside rope_and_store (tests/kernels/test_qk_norm_rope.py).
    TorchAttentionBackend().store_kv(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    out = TritonAttentionBackend().attend(q, k_cache, v_cache, meta, 32 ** -0.5)
    assert_matches_reference(out, q, k_cache, v_cache, meta)


def new_token_inputs(q: torch.Tensor, num_kv_heads: int, meta: AttentionMetadata,
                     qk_norm: bool, seed: int):
    """Raw new k/v for each query token, their positions, RoPE and (optionally) q/k norms."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens, _, head_dim = q.shape
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(q.dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(q.dtype)
    q_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()
    ends = meta.seq_lens.long().repeat_interleave(q_lens)
    starts = meta.query_start_loc[:-1].long().repeat_interleave(q_lens)
    positions = (ends - q_lens.repeat_interleave(q_lens)
                 + torch.arange(num_tokens) - starts).clamp(min=0)
    rotary = RotaryEmbedding(head_dim, 256, 1e4, None).to(q.dtype)
    norms: tuple[RMSNorm | None, RMSNorm | None] = (None, None)
    if qk_norm:
        norms = tuple(RMSNorm(head_dim, 1e-6).to(q.dtype) for _ in range(2))
        for norm in norms:
            norm.weight.data.copy_(1 + 0.3 * torch.randn(head_dim, generator=gen))
    return k, v, positions, rotary, norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "norm+rope"])
@pytest.mark.parametrize("group,head_dim,num_splits,narrow_offsets", [
    (2, 64, 1, False), (4, 32, 3, True), (1, 64, 6, False)])
@pytest.mark.parametrize("prefetch_kv", [False, True], ids=["in-loop", "prefetched"])
def test_decode_finishes_and_stores_the_new_tokens(dtype, qk_norm, group, head_dim, num_splits,
                                                   narrow_offsets, prefetch_kv):
    """With NewTokens the split kernel does rope_and_store's work: q/k norms, RoPE, the K/V
    store, and attention that includes the new key, for every split that may own it."""
    seq_lens = [37, 1, 70, 16, 0]  # the new key alone, several splits, a padding row (slot -1)
    q, k_cache, v_cache, meta = make_batch(seq_lens, [1] * 5, num_heads=2 * group,
                                           num_kv_heads=2, head_dim=head_dim, block_size=16,
                                           dtype=dtype, seed=group + head_dim)
    k, v, positions, rotary, norms = new_token_inputs(q, 2, meta, qk_norm, seed=num_splits)
    expected_caches = (k_cache.clone(), v_cache.clone())
    expected = TorchAttentionBackend().attention(positions, q.clone(), k.clone(), v.clone(),
                                                 *expected_caches, meta, rotary,
                                                 head_dim ** -0.5, *norms)
    weights = () if not qk_norm else (norms[0].weight, norms[1].weight, norms[0].eps)
    q_before = q.clone()
    out = decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                           meta.query_start_loc, meta.max_seq_len, head_dim ** -0.5,
                           num_splits=num_splits,
                           tuning=DecodeTuning(narrow_offsets=narrow_offsets,
                                               prefetch_kv=prefetch_kv),
                           seq_order=torch.tensor([2, 0, 3, 1, 4], dtype=torch.int32),
                           new_tokens=NewTokens(k, v, positions, meta.slot_mapping,
                                                rotary.cos_sin, *weights))
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(k_cache, expected_caches[0], **TOLERANCE[dtype])
    assert torch.equal(v_cache, expected_caches[1])
    assert torch.equal(q, q_before)  # the raw q is read, not rotated in place
    assert torch.equal(out[4], torch.zeros_like(out[4]))


@pytest.mark.parametrize("seq_lens,q_lens", [
    ([29, 12, 51], [1, 1, 1]),  # decode, one split: rope_and_store, then the split kernel
    ([29, 12, 140], [1, 1, 1]),  # decode, two splits: the split kernel finishes the new tokens
    ([29, 12, 51], [1, 12, 1]),  # mixed: rope_and_store, then the prefill kernel
], ids=["decode", "split-decode", "mixed"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "norm+rope"])
def test_backends_agree_from_projection_to_output(seq_lens, q_lens, qk_norm):
    """Both backends' attention(): norms, RoPE, store, attend, whichever kernels run."""
    q, k_cache, v_cache, meta = make_batch(seq_lens, q_lens, num_heads=8, num_kv_heads=2,
                                           head_dim=32, block_size=16, dtype=torch.float16,
                                           seed=5)
    k, v, positions, rotary, norms = new_token_inputs(q, 2, meta, qk_norm, seed=6)
    expected_caches = (k_cache.clone(), v_cache.clone())
    expected = TorchAttentionBackend().attention(positions, q.clone(), k.clone(), v.clone(),
                                                 *expected_caches, meta, rotary, 32 ** -0.5,
                                                 *norms)
    out = TritonAttentionBackend().attention(positions, q, k, v, k_cache, v_cache, meta, rotary,
                                             32 ** -0.5, *norms)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float16])
    torch.testing.assert_close(k_cache, expected_caches[0], **TOLERANCE[torch.float16])
    assert torch.equal(v_cache, expected_caches[1])


def test_split_decode_takes_one_stage_only_for_one_tile_splits_read_before_the_wait():
    block_n, sms = SPLIT_DECODE_TUNING.block_n, 132
    # Batch 1 of a graph captured for 512 keys: 8 splits of one tile, 64 programs.
    assert split_decode_tuning(64, 8 * block_n, 8, sms) == ONE_TILE_SPLIT_TUNING
    assert ONE_TILE_SPLIT_TUNING.num_stages == 1 and ONE_TILE_SPLIT_TUNING.prefetch_kv
    # Two tiles per split keep the pipelined loop, the first tile still read early.
    assert split_decode_tuning(256, 64 * block_n, 32, sms) == SPLIT_DECODE_TUNING
    assert SPLIT_DECODE_TUNING.num_stages > 1 and SPLIT_DECODE_TUNING.prefetch_kv
    # Too many programs to hold a tile through the wait: neither one stage nor the prefetch.
    crowded = split_decode_tuning(4 * sms, 8 * block_n, 8, sms)
    assert crowded == SPLIT_DECODE_TUNING._replace(prefetch_kv=False)


def test_num_decode_splits_fills_the_device_without_tiny_splits():
    assert num_decode_splits(256, 8, 4096, num_sms=132) == 1  # batch alone fills the GPU
    assert num_decode_splits(128, 8, 4096, num_sms=132) == 1
    assert num_decode_splits(1, 8, 100, num_sms=132) == 1  # too short to be worth splitting
    for batch in (1, 4, 8):  # latency-bound: five programs per SM
        splits = num_decode_splits(batch, 8, 4096, num_sms=132)
        assert splits > 1 and 4096 / splits >= MIN_TOKENS_PER_SPLIT
        assert batch * 8 * splits <= PROGRAMS_PER_SM * 132
    for batch in (16, 32, 64, 96, 112):  # about a wave of ragged contexts: evened out
        splits = num_decode_splits(batch, 8, 40960, num_sms=132)
        assert batch * 8 * splits >= BALANCE_TARGET * 132 > batch * 8 * (splits - 1)
    assert num_decode_splits(64, 8, 128, num_sms=132) == 2  # no slice under 64 keys
    assert num_decode_splits(1, 1, 10 ** 6, num_sms=132) == MAX_SPLITS
    for kv_heads in (2, 4, 8):  # one long sequence fills the device whatever its KV heads
        programs = kv_heads * num_decode_splits(1, kv_heads, 16384, num_sms=132)
        assert 132 <= programs <= PROGRAMS_PER_SM * 132
    assert num_decode_splits(0, 8, 0, num_sms=132) == 1


# Reading an fp8 cache. Writing one is checked on the GPU (tests/gpu/test_fused_kernels.py):
# Triton 3.6's interpreter rounds some values to fp8 wrongly (7.9 to 4.0, not 8.0).
FP8 = torch.float8_e4m3fn
# Products of fp8 values widened to fp16, against float64 on the same fp8 values.
FP8_CACHE_TOLERANCE = TOLERANCE[torch.float16]


def to_fp8_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # GARBAGE (1e3) is past fp8 e4m3's range and becomes NaN: a kernel reading a slot no
    # sequence owns returns NaN.
    return k_cache.to(FP8), v_cache.to(FP8)


@pytest.mark.parametrize("num_splits,narrow_offsets", [(1, False), (3, True), (2, False)])
def test_decode_reads_an_fp8_cache(num_splits, narrow_offsets):
    q, k_cache, v_cache, meta = make_batch([37, 1, 70, 16], [1] * 4, num_heads=8, num_kv_heads=2,
                                           head_dim=64, block_size=16, dtype=torch.float16,
                                           seed=11)
    k_cache, v_cache = to_fp8_caches(k_cache, v_cache)
    out = run_decode(q, k_cache, v_cache, meta, num_splits,
                     DecodeTuning(narrow_offsets=narrow_offsets))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, meta),
                               **FP8_CACHE_TOLERANCE)


def test_prefill_reads_an_fp8_cache():
    q, k_cache, v_cache, meta = make_batch([45, 23, 9], [13, 23, 1], num_heads=4, num_kv_heads=2,
                                           head_dim=64, block_size=16, dtype=torch.float16,
                                           seed=12)
    k_cache, v_cache = to_fp8_caches(k_cache, v_cache)
    out = run_prefill(q, k_cache, v_cache, meta)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, meta),
                               **FP8_CACHE_TOLERANCE)


# Sliding windows shorter than, equal to and past tile boundaries; soft-capping with peaked q.
@pytest.mark.parametrize("window,softcap", [(5, 0.0), (16, 0.0), (23, 0.0), (0, 5.0), (9, 3.0)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_window_and_softcap_match_reference(window, softcap, num_splits):
    seq_lens = [37, 1, 70, 16, 0]
    q, k_cache, v_cache, meta = make_batch(seq_lens, [1] * 5, num_heads=4, num_kv_heads=2,
                                           head_dim=32, block_size=16, seed=window)
    out = decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                           meta.query_start_loc, meta.max_seq_len, 32 ** -0.5,
                           num_splits=num_splits, window=window, softcap=softcap)
    want = paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), meta,
                                     32 ** -0.5, window, softcap)
    torch.testing.assert_close(out.double(), want, **TOLERANCE[torch.float32])
    if window:  # the window changes the result: the kernel did not just attend to everything
        full = paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), meta,
                                         32 ** -0.5, 0, softcap)
        assert not torch.allclose(want[2], full[2])


@pytest.mark.parametrize("window,softcap", [(5, 0.0), (20, 0.0), (0, 4.0), (7, 2.5)])
@pytest.mark.parametrize("group", [1, 4])
def test_prefill_window_and_softcap_match_reference(window, softcap, group):
    # Plain, chunked (cached prefix) and mixed rows: windows start mid-tile and mid-chunk.
    seq_lens, q_lens = [45, 23, 50, 9], [13, 23, 1, 9]
    q, k_cache, v_cache, meta = make_batch(seq_lens, q_lens, num_heads=2 * group,
                                           num_kv_heads=2, head_dim=32, block_size=16,
                                           seed=window + group)
    out = prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                            meta.query_start_loc, 32 ** -0.5, window=window, softcap=softcap)
    want = paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), meta,
                                     32 ** -0.5, window, softcap)
    torch.testing.assert_close(out.double(), want, **TOLERANCE[torch.float32])


def poison_slid_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                       q_lens: list[int], window: int) -> None:
    """NaN in every block that each of its sequence's queries' windows has passed wholly: the
    blocks the scheduler frees under a sliding window, maybe reused by another sequence."""
    block_size = k_cache.shape[1]
    for i, (n, q_len) in enumerate(zip(meta.seq_lens.tolist(), q_lens)):
        passed = max(0, n - q_len - window + 1) // block_size
        for block in meta.block_tables[i, :passed].tolist():
            k_cache[block] = float("nan")
            v_cache[block] = float("nan")


@pytest.mark.parametrize("window", [5, 16, 23])
def test_kernels_never_read_blocks_the_window_passed(window):
    """Decode (split or not) and prefill tiles that start before the window mask the keys they
    would read there, so freed blocks (NaN here) leave the outputs as the reference's."""
    for seq_lens, q_lens in (([37, 1, 70, 100], [1] * 4), ([45, 23, 80, 9], [13, 23, 1, 9])):
        q, k_cache, v_cache, meta = make_batch(seq_lens, q_lens, num_heads=4, num_kv_heads=2,
                                               head_dim=32, block_size=8, seed=window)
        want = paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), meta,
                                         32 ** -0.5, window, 0.0)
        poison_slid_blocks(k_cache, v_cache, meta, q_lens, window)
        assert k_cache.isnan().any()
        if max(q_lens) == 1:
            for splits in (1, 3):
                out = decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, meta.max_seq_len, 32 ** -0.5,
                                       num_splits=splits, window=window)
                torch.testing.assert_close(out.double(), want, **TOLERANCE[torch.float32])
        out = prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                meta.query_start_loc, 32 ** -0.5, window=window)
        torch.testing.assert_close(out.double(), want, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_window_with_new_tokens_matches_torch_backend(num_splits):
    """The split kernel finishing the new tokens honours the window, the soft cap and the
    sinks too."""
    sinks = torch.tensor([0.3, -2.0, 1.5, 4.0])
    seq_lens = [37, 1, 70, 16, 0]
    q, k_cache, v_cache, meta = make_batch(seq_lens, [1] * 5, num_heads=4, num_kv_heads=2,
                                           head_dim=32, block_size=16, seed=11)
    k, v, positions, rotary, _ = new_token_inputs(q, 2, meta, False, seed=2)
    expected_caches = (k_cache.clone(), v_cache.clone())
    expected = TorchAttentionBackend().attention(positions, q.clone(), k.clone(), v.clone(),
                                                 *expected_caches, meta, rotary, 32 ** -0.5,
                                                 window=9, softcap=3.0, sinks=sinks)
    out = decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                           meta.query_start_loc, meta.max_seq_len, 32 ** -0.5,
                           num_splits=num_splits, window=9, softcap=3.0, sinks=sinks,
                           new_tokens=NewTokens(k, v, positions, meta.slot_mapping,
                                                rotary.cos_sin))
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_and_prefill_with_attention_sinks_match_reference(window, num_splits):
    """GPT-OSS's sinks (one more logit per head, no value), alone and with a window; an empty
    sequence stays zero; the reference is checked against softmax over [scores, sink]."""
    gen = torch.Generator().manual_seed(5)
    sinks = 2 * torch.randn(4, generator=gen)
    q, k_cache, v_cache, meta = make_batch([37, 1, 70, 16, 0], [1] * 5, num_heads=4,
                                           num_kv_heads=2, head_dim=32, block_size=16, seed=7)
    want = paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), meta,
                                     32 ** -0.5, window, 0.0, sinks.double())
    assert not torch.allclose(want, reference(q, k_cache, v_cache, meta))
    out = decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                           meta.query_start_loc, meta.max_seq_len, 32 ** -0.5,
                           num_splits=num_splits, window=window, sinks=sinks)
    torch.testing.assert_close(out.double(), want, **TOLERANCE[torch.float32])
    assert torch.equal(out[4], torch.zeros_like(out[4]))

    q, k_cache, v_cache, meta = make_batch([45, 23, 50], [13, 23, 1], num_heads=4,
                                           num_kv_heads=2, head_dim=32, block_size=16, seed=8)
    out = prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                            meta.query_start_loc, 32 ** -0.5, window=window, sinks=sinks)
    want = paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), meta,
                                     32 ** -0.5, window, 0.0, sinks.double())
    torch.testing.assert_close(out.double(), want, **TOLERANCE[torch.float32])


def test_sink_reference_is_softmax_with_one_more_logit():
    q, k_cache, v_cache, meta = make_batch([9], [9], num_heads=2, num_kv_heads=1, head_dim=16,
                                           block_size=16, seed=9)
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
    out = paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), meta,
                                    0.25, sinks=sinks)
    block = meta.block_tables[0, 0]
    k, v = k_cache[block, :9, 0].double(), v_cache[block, :9, 0].double()
    for h in range(2):
        scores = q[:, h].double() @ k.T * 0.25
        scores = scores.masked_fill(torch.ones(9, 9).triu(1).bool(), float("-inf"))
        probs = torch.softmax(torch.cat([scores, sinks[h].expand(9, 1)], -1), -1)[:, :-1]
        torch.testing.assert_close(out[:, h], probs @ v)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "norm+rope"])
def test_partial_rotary_store_matches_torch_backend(qk_norm):
    """Partial rotary (Phi-4-mini) on the GPU path: RoPE on the first 16 of 32 features
    unfused, then the fused store with a table that rotates nothing; padding (slot -1) unstored."""
    q, k_cache, v_cache, meta = make_batch([20, 9, 0], [1, 1, 1], num_heads=4, num_kv_heads=2,
                                           head_dim=32, block_size=16, seed=12)
    k, v, positions, _, norms = new_token_inputs(q, 2, meta, qk_norm, seed=3)
    rotary = RotaryEmbedding(32, 256, 1e4, None, rotary_dim=16)
    assert rotary.partial
    want_caches = (k_cache.clone(), v_cache.clone())
    want = TorchAttentionBackend().rope_and_store(positions, q.clone(), k.clone(), v.clone(),
                                                  *want_caches, meta.slot_mapping, rotary,
                                                  *norms)
    got = TritonAttentionBackend().rope_and_store(positions, q, k, v, k_cache, v_cache,
                                                  meta.slot_mapping, rotary, *norms)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(k_cache, want_caches[0], atol=1e-6, rtol=0)
    assert torch.equal(v_cache, want_caches[1])
    assert torch.equal(got[..., 16:], (norms[0](q) if qk_norm else q)[..., 16:])  # unrotated


def test_gemma_head_dim_256_with_window_and_softcap():
    """Gemma's 256-wide heads take the smaller key tiles; window and soft cap on."""
    q, k_cache, v_cache, meta = make_batch([40, 23], [17, 1], num_heads=4, num_kv_heads=2,
                                           head_dim=256, block_size=16, seed=13)
    out = prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                            meta.query_start_loc, 256 ** -0.5, window=9, softcap=5.0)
    want = paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), meta,
                                     256 ** -0.5, 9, 5.0)
    torch.testing.assert_close(out.double(), want, **TOLERANCE[torch.float32])
    q, k_cache, v_cache, meta = make_batch([40, 23], [1, 1], num_heads=4, num_kv_heads=2,
                                           head_dim=256, block_size=16, seed=14)
    out = decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                           meta.query_start_loc, meta.max_seq_len, 256 ** -0.5, num_splits=2,
                           window=9, softcap=5.0)
    want = paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), meta,
                                     256 ** -0.5, 9, 5.0)
    torch.testing.assert_close(out.double(), want, **TOLERANCE[torch.float32])


SHAPE = dict(num_heads=16, num_kv_heads=8, head_dim=128)


@pytest.mark.parametrize("num_seqs,max_seq_len", [(1, 128), (1, 8192), (4, 2048), (64, 4096)])
@pytest.mark.parametrize("fp8,new_tokens", [(False, False), (True, False), (False, True)])
def test_decode_select_without_an_entry_is_the_heuristic(num_seqs, max_seq_len, fp8,
                                                          new_tokens):
    """An untuned shape launches as the rules above say: their splits, the finishing launch's
    tiles with new tokens, two warps over fp8, the defaults otherwise."""
    config = decode_select_from_table({}, num_seqs, *SHAPE.values(), max_seq_len, fp8,
                                      new_tokens, num_sms=132)
    splits = num_decode_splits(num_seqs, 8, max_seq_len, num_sms=132)
    if new_tokens:
        tiles = split_decode_tuning(num_seqs * 8 * splits, max_seq_len, splits, 132)
    else:
        tiles = DecodeTuning(num_warps=2) if fp8 else DecodeTuning()
    assert config == tiles._replace(num_splits=splits)


def test_decode_select_takes_the_entry_of_its_heads_batch_and_context():
    key = decode_shape_key(*SHAPE.values(), fp8=False, new_tokens=False)
    table = {key: {"1x2048": {"num_splits": 20, "block_n": 32, "num_warps": 8},
                   "2x2048": {"num_stages": 2}, "1x8192": {"num_splits": 1000}}}

    def pick(num_seqs, max_seq_len, **kw):
        return decode_select_from_table(table, num_seqs, *SHAPE.values(), max_seq_len,
                                        kw.get("fp8", False), kw.get("new_tokens", False), 132)

    heuristic = decode_select_from_table({}, 1, *SHAPE.values(), 2048, False, False, 132)
    # Contexts 513-2048 share a bucket, as batches of 2 do (an entry may tune a few fields).
    for context in (1280, 2048):
        assert pick(1, context) == DecodeTuning(num_splits=20, block_n=32, num_warps=8)
    assert pick(2, 2000) == decode_select_from_table({}, 2, *SHAPE.values(), 2000, False,
                                                     False, 132)._replace(num_stages=2)
    # A split count past what the context holds is cut to its slices of 64 keys.
    assert pick(1, 8192).num_splits == 8192 // MIN_TOKENS_PER_SPLIT
    # Other buckets, other heads, an fp8 cache or the finishing launch: untouched.
    assert pick(1, 300) != pick(1, 1280) and pick(4, 2048).block_n == heuristic.block_n
    assert pick(1, 2048, fp8=True).num_warps == 2
    assert pick(1, 2048, new_tokens=True).prefetch_kv
    table[key]["1x2048"]["block_m"] = 16
    with pytest.raises(ValueError, match="block_m"):
        pick(1, 2048)


def test_decode_candidates_are_launchable_and_correct():
    """Every split count the tuner may time computes the same attention (tiles are fixed
    under the interpreter)."""
    q, k_cache, v_cache, meta = make_batch([300, 17, 64], [1, 1, 1], num_heads=4,
                                           num_kv_heads=2, head_dim=32, block_size=16, seed=9)
    found = decode_candidates(3, 2, 300, False, False, num_sms=4)
    assert found[0] == decode_select_from_table({}, 3, 4, 2, 32, 300, False, False, 4)
    assert len(found) == len(set(found)) and len({c.num_splits for c in found}) > 1
    for splits in sorted({c.num_splits for c in found}):
        config = next(c for c in found if c.num_splits == splits)
        assert_matches_reference(run_decode(q, k_cache, v_cache, meta, tuning=config),
                                 q, k_cache, v_cache, meta)


def test_backend_launches_the_tuned_split_count(monkeypatch):
    """The backend's decode goes through select: a tuned entry sets its split count, here one
    that makes a batch the rules would not split finish its new tokens in the split kernel."""
    import nanoserve.kernels.decode_attention as decode

    seq_lens = [29, 12, 200, 5, 70, 130, 64, 8]  # 8 x 2 programs fill the 4 nominal SMs
    q, k_cache, v_cache, meta = make_batch(seq_lens, [1] * 8, num_heads=8, num_kv_heads=2,
                                           head_dim=32, block_size=16, dtype=torch.float16,
                                           seed=5)
    k, v, positions, rotary, norms = new_token_inputs(q, 2, meta, True, seed=6)
    expected_caches = (k_cache.clone(), v_cache.clone())
    expected = TorchAttentionBackend().attention(positions, q.clone(), k.clone(), v.clone(),
                                                 *expected_caches, meta, rotary, 32 ** -0.5,
                                                 *norms)
    key = decode_shape_key(8, 2, 32, fp8=False, new_tokens=True)
    assert decode.select(8, 8, 2, 32, 200, q.dtype, True, q.device).num_splits == 1
    monkeypatch.setattr(decode, "load_table", lambda op, device: {key: {"8x512": {
        "num_splits": 3}}})
    clear_caches()  # select's answer above was remembered
    launched = []
    real = decode.decode_attention
    monkeypatch.setattr("nanoserve.attention.triton_backend.decode_attention",
                        lambda *a, **kw: launched.append(kw) or real(*a, **kw))
    out = TritonAttentionBackend().attention(positions, q, k, v, k_cache, v_cache, meta, rotary,
                                             32 ** -0.5, *norms)
    assert launched[0]["tuning"].num_splits == 3 and launched[0]["new_tokens"] is not None
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float16])
    torch.testing.assert_close(k_cache, expected_caches[0], **TOLERANCE[torch.float16])


def test_hybrid_cache_engine_on_the_triton_backend_gives_the_torch_backends_tokens(
        tokenizer_dir, tmp_path, monkeypatch):
    """A tiny Gemma 3 with a table per group of layers (three sliding, one full): its kernels
    read each group's tables and slots, strided views of one step's upload, and give the
    PyTorch backend's tokens; prompts longer than the window and than a prefill chunk."""
    import random

    from test_hybrid_cache import save_gemma3

    from reference import greedy_on_both_backends
    from transformers import AutoConfig

    from nanoserve.attention.cache_spec import cache_groups
    from nanoserve.config import ModelConfig

    path = save_gemma3(tmp_path, tokenizer_dir)
    windows = ModelConfig.from_hf(AutoConfig.from_pretrained(path)).layer_windows
    assert cache_groups(windows).num_groups == 4
    rng = random.Random(0)
    prompts = [[rng.randint(1, 60) for _ in range(n)] for n in (5, 40, 23, 9)]
    want, got = greedy_on_both_backends(path, prompts, 10, monkeypatch, max_num_seqs=4,
                                        block_size=4, max_num_batched_tokens=32)
    assert got == want
