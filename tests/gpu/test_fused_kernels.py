"""On a CUDA device, at the real shapes in bf16: the kernels that took over other ops' work
(split decode finishing the new tokens, o_proj merging batch-1 splits, the pre-norm and the
residual add inside the batch-1 GEMVs, the norm adding up split-K partial sums, the fused MoE
experts) against the PyTorch path they replace.
tests/kernels checks the same under the interpreter at small sizes. Skipped without CUDA.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # Before the kernels are imported: in one pytest process tests/kernels later sets
    # TRITON_INTERPRET=1, and kernels defined without it would not run under the interpreter.
    pytest.skip("needs a CUDA device", allow_module_level=True)

from nanoserve.attention.backend import SplitPartials  # noqa: E402
from nanoserve.attention.metadata import AttentionMetadata  # noqa: E402
from nanoserve.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from nanoserve.attention.triton_backend import (  # noqa: E402
    MERGE_IN_O_PROJ_MAX_SPLITS,
    SPLIT_DECODE_TUNING,
    TritonAttentionBackend,
)
from nanoserve.kernels.common import device_sm_count  # noqa: E402
from nanoserve.kernels.decode_attention import (  # noqa: E402
    NewTokens,
    decode_attention,
    num_decode_splits,
)
from nanoserve.kernels.fused_moe import fused_experts, route_top_k  # noqa: E402
from nanoserve.kernels.merged_o_proj import merged_o_proj  # noqa: E402
from nanoserve.kernels.skinny_gemm import (  # noqa: E402
    TUNED_FEW_ROWS,
    serves,
    skinny_linear,
    skinny_rms_linear,
)
from nanoserve.layers.activation import silu_and_mul_torch  # noqa: E402
from nanoserve.layers.linear import linear  # noqa: E402
from nanoserve.layers.moe import experts_loop  # noqa: E402
from nanoserve.layers.norm import (  # noqa: E402
    PartialSums,
    RMSNorm,
    add_rms_norm_torch,
    rms_norm_torch,
)
from nanoserve.layers.rotary import RotaryEmbedding  # noqa: E402
from nanoserve.layers.split_k import split_k_partial_sums, split_k_parts  # noqa: E402

MAX_POSITIONS = 40960  # Qwen3's: the split count the decode graphs are captured with
BF16 = dict(atol=2e-2, rtol=2e-2)
BF16_ROTATED = dict(atol=5e-2, rtol=2e-2)
FP8_STEP = dict(atol=2e-2, rtol=0.13)


def decode_case(seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                block_size: int, dtype: torch.dtype, device: str, seed: int):
    """A decode step over a random paged cache (blocks in shuffled order), with each sequence's
    new token raw from the projection: (q, k, v, positions, k_cache, v_cache, meta)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    slots, start = [], 0
    for i, (n, count) in enumerate(zip(seq_lens, blocks_per_seq)):
        tables[i, :count] = order[start:start + count]
        start += count
        last = n - 1
        slots.append(int(tables[i, last // block_size]) * block_size + last % block_size)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    num_seqs = len(seq_lens)
    q = 2 * torch.randn(num_seqs, num_heads, head_dim, generator=gen)
    k = torch.randn(num_seqs, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_seqs, num_kv_heads, head_dim, generator=gen)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=tables.to(device), max_query_len=1, max_seq_len=max(seq_lens))
    positions = torch.tensor([n - 1 for n in seq_lens], dtype=torch.int64, device=device)
    on = [t.to(device=device, dtype=dtype) for t in (q, k, v, k_cache, v_cache)]
    return (*on[:3], positions, *on[3:], meta)


def check_split_decode(seq_lens: list[int], group: int, head_dim: int, dtype: torch.dtype,
                       device: str, num_kv_heads: int = 8, block_size: int = 16,
                       cache_dtype: torch.dtype | None = None, prefetch_kv: bool = True) -> None:
    """``cache_dtype``: the KV cache's, when not the model's (fp8). With the engine's tuning
    for split decode, the first K/V tile loaded before the wait or not."""
    q, k, v, positions, k_cache, v_cache, meta = decode_case(
        seq_lens, group * num_kv_heads, num_kv_heads, head_dim, block_size, dtype, device,
        seed=len(seq_lens) + group)
    if cache_dtype is not None:
        k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    rotary = RotaryEmbedding(head_dim, MAX_POSITIONS, 1e6, None).to(device)
    norms = [RMSNorm(head_dim, 1e-6).to(device=device, dtype=dtype) for _ in range(2)]
    for norm in norms:
        norm.weight.data.normal_(1.0, 0.3)
    scale = head_dim ** -0.5
    expected_caches = (k_cache.clone(), v_cache.clone())
    expected = TorchAttentionBackend().attention(positions, q.clone(), k.clone(), v.clone(),
                                                 *expected_caches, meta, rotary, scale, *norms)
    splits = num_decode_splits(len(seq_lens), num_kv_heads, MAX_POSITIONS,
                               device_sm_count(q.device))
    assert splits > 1, "the engine finishes new tokens in the split kernel only when it splits"
    order = sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i])
    out = decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                           meta.query_start_loc, meta.max_seq_len, scale, num_splits=splits,
                           seq_order=torch.tensor(order, dtype=torch.int32, device=device),
                           new_tokens=NewTokens(k, v, positions, meta.slot_mapping,
                                                rotary.cos_sin, norms[0].weight,
                                                norms[1].weight, 1e-6),
                           tuning=SPLIT_DECODE_TUNING._replace(prefetch_kv=prefetch_kv))
    torch.testing.assert_close(out.float(), expected.float(), **BF16)
    # An fp8 cache: the same bf16 keys rounded to fp8, up to one fp8 step where the fused
    # kernel's rotation differs from the reference's in its last bf16 bit.
    torch.testing.assert_close(k_cache.float(), expected_caches[0].float(),
                               **(BF16 if cache_dtype is None else FP8_STEP))
    assert torch.equal(v_cache.float(), expected_caches[1].float())


def check_norm_in_gemv(n: int, k: int, dtype: torch.dtype, device: str) -> None:
    """The residual add in the batch-1 GEMV, which also sums the updated row's squares, then
    the pre-norm inside the next GEMV (its weight folded into W), against the add, the norm
    module and the product."""
    gen = torch.Generator().manual_seed(n + k)
    h = (2 * torch.randn(1, k, generator=gen)).to(device, dtype)
    x = torch.randn(1, n, generator=gen).to(device, dtype)
    back = torch.randn(k, n, generator=gen).div(n ** 0.5).to(device, dtype)
    residual, sum_squares = h.clone(), torch.zeros(1, dtype=torch.float64, device=device)
    assert skinny_linear(x, back, residual=residual, sum_squares=sum_squares) is residual
    assert torch.equal(residual, skinny_linear(x, back) + h)
    torch.testing.assert_close(sum_squares, residual.double().pow(2).sum(-1), rtol=1e-6, atol=0)
    norm_weight = (1 + 0.3 * torch.randn(k, generator=gen)).to(device, dtype)
    weight = torch.randn(n, k, generator=gen).div(k ** 0.5).to(device, dtype)
    folded = (weight.float() * norm_weight.float()[None, :]).to(dtype)
    expected = rms_norm_torch(residual, norm_weight, 1e-6).double() @ weight.double().T
    normed = skinny_rms_linear(residual, sum_squares, 1e-6, folded)
    torch.testing.assert_close(normed.double(), expected, **BF16)


@pytest.mark.parametrize("seq_lens", [[300], [4000, 17, 1, 900]], ids=["batch1", "batch4"])
@pytest.mark.parametrize("group", [2, 4], ids=["qwen3-0.6b", "qwen3-8b"])
@pytest.mark.parametrize("prefetch_kv", [True, False], ids=["prefetched", "in-loop"])
def test_split_decode_finishing_new_tokens_matches_torch_path(seq_lens, group, prefetch_kv):
    check_split_decode(seq_lens, group, 128, torch.bfloat16, "cuda", prefetch_kv=prefetch_kv)


@pytest.mark.parametrize("context", [1, 300, 511])
@pytest.mark.parametrize("group,hidden", [(2, 1024), (4, 4096)], ids=["qwen3-0.6b", "qwen3-8b"])
def test_o_proj_merging_batch1_splits_matches_torch_path(context, group, hidden):
    """Batch-1 split decode in the short-context graph (8 splits) leaves its partials, and o_proj
    merges them, adds into the residual and sums its squares: against attention, F.linear and
    the add."""
    q, k, v, positions, k_cache, v_cache, meta = decode_case(
        [context], group * 8, 8, 128, 16, torch.bfloat16, "cuda", seed=context + group)
    rotary = RotaryEmbedding(128, MAX_POSITIONS, 1e6, None).to("cuda")
    norms = [RMSNorm(128, 1e-6).to("cuda", torch.bfloat16) for _ in range(2)]
    gen = torch.Generator().manual_seed(hidden)
    weight = torch.randn(hidden, group * 8 * 128, generator=gen).div(32).to("cuda", torch.bfloat16)
    residual = (2 * torch.randn(1, hidden, generator=gen)).to("cuda", torch.bfloat16)
    expected_caches = (k_cache.clone(), v_cache.clone())
    attention = TorchAttentionBackend().attention(positions, q.clone(), k.clone(), v.clone(),
                                                  *expected_caches, meta, rotary, 128 ** -0.5,
                                                  *norms)
    expected = F.linear(attention.reshape(1, -1), weight) + residual
    graph_meta = dataclasses.replace(meta, max_seq_len=512)  # the graph's cap sets the splits
    parts = TritonAttentionBackend().attention(positions, q, k, v, k_cache, v_cache, graph_meta,
                                               rotary, 128 ** -0.5, *norms, partials_ok=True)
    assert isinstance(parts, SplitPartials)
    assert parts.lse.shape == (1, group * 8, MERGE_IN_O_PROJ_MAX_SPLITS)
    sum_squares = torch.zeros(1, dtype=torch.float64, device="cuda")
    merged_o_proj(parts.lse, parts.out, weight, residual, sum_squares)
    torch.testing.assert_close(residual.float(), expected.float(), **BF16)
    torch.testing.assert_close(sum_squares, residual.double().pow(2).sum(-1), rtol=1e-6, atol=0)
    torch.testing.assert_close(k_cache.float(), expected_caches[0].float(), **BF16)


@pytest.mark.parametrize("seq_lens", [[300], [4000, 17, 1, 900]], ids=["batch1", "batch4"])
def test_split_decode_with_an_fp8_cache(seq_lens):
    check_split_decode(seq_lens, 2, 128, torch.bfloat16, "cuda",
                       cache_dtype=torch.float8_e4m3fn)


def test_prefill_stores_and_reads_an_fp8_cache():
    """A mixed batch through the Triton backend (the fused q/k-norm + RoPE store into fp8,
    then the prefill kernel) against the PyTorch backend on the same fp8 cache."""
    gen = torch.Generator().manual_seed(21)
    q_lens, seq_lens, block_size, kv_heads, head_dim = [1, 200, 37], [90, 260, 37], 16, 8, 128
    blocks = [math.ceil(n / block_size) for n in seq_lens]
    order = torch.randperm(sum(blocks) + 2, generator=gen)
    tables = torch.zeros(3, max(blocks), dtype=torch.int32)
    slots, start = [], 0
    for i, (n, q_len, count) in enumerate(zip(seq_lens, q_lens, blocks)):
        tables[i, :count] = order[start:start + count]
        start += count
        slots += [int(tables[i, p // block_size]) * block_size + p % block_size
                  for p in range(n - q_len, n)]
    shape = (len(order), block_size, kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to("cuda", torch.float8_e4m3fn)
                        for _ in range(2))
    tokens = sum(q_lens)
    q, k, v = (torch.randn(tokens, heads, head_dim, generator=gen).to("cuda", torch.bfloat16)
               for heads in (16, kv_heads, kv_heads))
    positions = torch.cat([torch.arange(n - q_len, n) for n, q_len in zip(seq_lens, q_lens)])
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 201, 238], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        slot_mapping=torch.tensor(slots, device="cuda"), block_tables=tables.cuda(),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens))
    rotary = RotaryEmbedding(head_dim, MAX_POSITIONS, 1e6, None).to("cuda")
    norms = [RMSNorm(head_dim, 1e-6).to("cuda", torch.bfloat16) for _ in range(2)]
    expected_caches = (k_cache.clone(), v_cache.clone())
    args = (positions.cuda(), q, k, v)
    expected = TorchAttentionBackend().attention(*(t.clone() for t in args), *expected_caches,
                                                 meta, rotary, head_dim ** -0.5, *norms)
    out = TritonAttentionBackend().attention(*args, k_cache, v_cache, meta, rotary,
                                             head_dim ** -0.5, *norms)
    torch.testing.assert_close(out.float(), expected.float(), **BF16)
    torch.testing.assert_close(k_cache.float(), expected_caches[0].float(), **FP8_STEP)
    assert torch.equal(v_cache.float(), expected_caches[1].float())


@pytest.mark.parametrize("n,k", [(4096, 1024), (6144, 1024), (6144, 4096), (24576, 4096)],
                         ids=["qkv", "gate_up", "qkv-8b", "gate_up-8b"])
def test_norm_in_gemv_matches_torch_path(n, k):
    check_norm_in_gemv(n, k, torch.bfloat16, "cuda")


@pytest.mark.parametrize("rows", sorted(TUNED_FEW_ROWS))
def test_few_rows_through_the_skinny_chain_match_torch_path(rows):
    """Batches of 2 (and every row count ``TUNED_FEW_ROWS`` has) at Qwen3-0.6B's shapes, with
    their tiles: o_proj adds into the residual and sums each row's squares, gate/up normalises
    with them and writes the activation, down adds in, qkv normalises; each against the torch
    path in float64 from the same inputs."""
    gen = torch.Generator().manual_seed(rows)

    def rand(*shape, std=1.0):
        return (std * torch.randn(*shape, generator=gen)).to("cuda", torch.bfloat16)

    hidden, heads_dim, inter, qkv_out = 1024, 2048, 3072, 4096
    o_w, down_w = rand(hidden, heads_dim, std=heads_dim ** -0.5), rand(hidden, inter,
                                                                        std=inter ** -0.5)
    gate_up_w, qkv_w = rand(2 * inter, hidden, std=hidden ** -0.5), rand(qkv_out, hidden,
                                                                          std=hidden ** -0.5)
    for w in (o_w, down_w, gate_up_w, qkv_w):
        assert serves(rows, *w.shape)
    ones = torch.ones(hidden, dtype=torch.float64, device="cuda")
    sizes = torch.logspace(math.log10(0.5), math.log10(8), rows)[:, None]
    residual = rand(rows, hidden) * sizes.to("cuda", torch.bfloat16)
    attn = rand(rows, heads_dim)

    before, sums = residual.clone(), torch.zeros(rows, dtype=torch.float64, device="cuda")
    skinny_linear(attn, o_w, residual=residual, sum_squares=sums)
    expected = before.double() + attn.double() @ o_w.double().T
    torch.testing.assert_close(residual.double(), expected, **BF16)
    torch.testing.assert_close(sums, residual.double().pow(2).sum(-1), rtol=1e-6, atol=0)
    act = skinny_rms_linear(residual, sums, 1e-6, gate_up_w, activate=True)
    expected = silu_and_mul_torch(rms_norm_torch(residual.double(), ones, 1e-6)
                                  @ gate_up_w.double().T)
    torch.testing.assert_close(act.double(), expected, **BF16)

    before, sums = residual.clone(), torch.zeros(rows, dtype=torch.float64, device="cuda")
    skinny_linear(act, down_w, residual=residual, sum_squares=sums)
    expected = before.double() + act.double() @ down_w.double().T
    torch.testing.assert_close(residual.double(), expected, **BF16)
    qkv = skinny_rms_linear(residual, sums, 1e-6, qkv_w)
    expected = rms_norm_torch(residual.double(), ones, 1e-6) @ qkv_w.double().T
    torch.testing.assert_close(qkv.double(), expected, **BF16)


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("n,k", [(1024, 2048), (1024, 3072), (4096, 4096), (4096, 12288)],
                         ids=["o_proj", "down", "o_proj-8b", "down-8b"])
def test_sums_of_squares_are_the_same_every_run(rows, n, k):
    """Hundreds of programs add their shares of a row's sum of squares in whatever order they
    finish: the sum must not depend on that order, or a norm, the logits and a seeded draw
    near a boundary change from one run of the same step to the next."""
    if not serves(rows, n, k):
        pytest.skip("the skinny GEMV does not take this shape at this row count")
    gen = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=gen).to("cuda", torch.bfloat16)
    w = torch.randn(n, k, generator=gen).div(k ** 0.5).to("cuda", torch.bfloat16)
    start = (3 * torch.randn(rows, n, generator=gen)).to("cuda", torch.bfloat16)
    runs = []
    for _ in range(200):
        residual, sums = start.clone(), torch.zeros(rows, dtype=torch.float64, device="cuda")
        skinny_linear(x, w, residual=residual, sum_squares=sums)
        runs.append(sums)
    distinct = {tuple(s.tolist()) for s in runs}
    assert len(distinct) == 1, f"{len(distinct)} different sums in 200 runs"


@pytest.mark.parametrize("n,k", [(6144, 1024), (24576, 4096)], ids=["qwen3-0.6b", "qwen3-8b"])
def test_gate_up_writing_the_activation_matches_torch_path(n, k):
    """Batch-1 gate/up with the pre-norm, writing silu(gate) * up at the tuned tiles: against
    the same GEMV writing [gate | up] then silu_and_mul, and against float64."""
    gen = torch.Generator().manual_seed(n)
    h = (2 * torch.randn(1, k, generator=gen)).to("cuda", torch.bfloat16)
    weight = torch.randn(n, k, generator=gen).div(k ** 0.5).to("cuda", torch.bfloat16)
    sum_squares = h.double().pow(2).sum(-1)
    act = skinny_rms_linear(h, sum_squares, 1e-6, weight, activate=True)
    two_step = silu_and_mul_torch(skinny_rms_linear(h, sum_squares, 1e-6, weight))
    torch.testing.assert_close(act.float(), two_step.float(), **BF16)
    expected = silu_and_mul_torch(rms_norm_torch(h.double(), torch.ones(k, dtype=torch.float64,
                                                                        device="cuda"), 1e-6)
                                  @ weight.double().T)
    torch.testing.assert_close(act.double(), expected, **BF16)


@pytest.mark.parametrize("rows", [2, 64, 200])
@pytest.mark.parametrize("k", [2048, 3072], ids=["o_proj", "down_proj"])
def test_split_k_projection_and_norm_match_unsplit(rows, k):
    gen = torch.Generator().manual_seed(rows + k)
    x = torch.randn(rows, k, generator=gen).to("cuda", torch.bfloat16)
    weight = torch.randn(1024, k, generator=gen).div(k ** 0.5).to("cuda", torch.bfloat16)
    residual = (4 * torch.randn(rows, 1024, generator=gen)).to("cuda", torch.bfloat16)
    norm = RMSNorm(1024, 1e-6).to("cuda", torch.bfloat16)
    norm.weight.data.normal_(1.0, 0.3)
    parts = split_k_partial_sums(x, weight, None)
    assert isinstance(parts, PartialSums)
    assert parts.parts.shape == (split_k_parts(rows, 1024, k), rows, 1024)
    expected, expected_residual = add_rms_norm_torch(linear(x, weight, None), residual,
                                                     norm.weight, 1e-6)
    out, out_residual = norm(parts, residual.clone())
    torch.testing.assert_close(out_residual.float(), expected_residual.float(), **BF16)
    torch.testing.assert_close(out.float(), expected.float(), **BF16)


@pytest.mark.parametrize("rows", [8, 64, 300])
@pytest.mark.parametrize("hidden,inner", [(1024, 3072), (4096, 12288)], ids=["0.6b", "8b"])
def test_norm_left_to_the_kernels_after_the_projections(rows, hidden, inner):
    """From ``linear.EPILOGUE_MIN_ROWS`` rows (all three row counts here), o_proj
    adds into the residual (cuBLAS's C), gate/up projects that residual with the norm's
    weight folded in and SiLU-and-mul applies the norm's 1/rms; the qkv side hands its
    factor to q/k-norm + RoPE + store. Against float64, and the two backends against each
    other on the scaled q, k and v."""
    from nanoserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear
    from nanoserve.layers.norm import AddedToResidual, RowScale
    gen = torch.Generator().manual_seed(rows + hidden)

    def rand(*shape, std=1.0):
        return (std * torch.randn(*shape, generator=gen)).to("cuda", torch.bfloat16)

    with torch.device("cuda"):
        o_proj = RowParallelLinear(2 * hidden, hidden).to(torch.bfloat16)
        gate_up = MergedColumnParallelLinear(hidden, [inner] * 2).to(torch.bfloat16)
        norm = RMSNorm(hidden, 1e-6).to(torch.bfloat16)
    o_proj.weight.data.copy_(rand(hidden, 2 * hidden, std=(2 * hidden) ** -0.5))
    gate_up.weight.data.copy_(rand(2 * inner, hidden, std=hidden ** -0.5))
    norm.weight.data.copy_(rand(hidden, std=0.3) + 1)
    attn_out, residual = rand(rows, 2 * hidden), rand(rows, hidden, std=4.0)
    h = residual.double() + attn_out.double() @ o_proj.weight.double().T
    expected = silu_and_mul_torch(rms_norm_torch(h, norm.weight.double(), 1e-6)
                                  @ gate_up.weight.double().T)
    # The launches this replaces, in bf16: the GEMM, add + RMSNorm, the GEMM, SiLU-and-mul.
    normed, _ = add_rms_norm_torch(linear(attn_out, o_proj.weight, None), residual.clone(),
                                   norm.weight, 1e-6)
    unfused = silu_and_mul_torch(linear(normed, gate_up.weight, None))

    gate_up.fold_norm(norm)
    o_proj.adds_into_residual = True
    marker, stream = o_proj.forward_for_norm(attn_out, residual)
    assert isinstance(marker, AddedToResidual) and marker.sum_squares is None
    assert stream is residual
    torch.testing.assert_close(stream.double(), h, **BF16)
    act, _, scale = gate_up.forward_normed(marker, stream, norm, activate=True)
    assert scale is None
    # As close to float64 as the unfused launches. Across millions of outputs either path has
    # a few past any fixed bf16 tolerance, and which few is chance: the mean error decides,
    # the worst one only bounds the outliers (a lost or wrong factor moves both by far more).
    error, unfused_error = (act.double() - expected).abs(), (unfused.double() - expected).abs()
    assert error.mean() <= 1.1 * unfused_error.mean()
    assert error.max() <= 2 * unfused_error.max()

    heads, kv_heads, head_dim = hidden // 128, 8, 128
    qkv = rand(rows, (heads + 2 * kv_heads) * head_dim)
    q, k, v = (t.reshape(rows, -1, head_dim) for t in
               qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1))
    row_scale = RowScale(residual, 1e-6)
    cache_shape = (rows // 16 + 2, 16, kv_heads, head_dim)
    caches = [torch.zeros(cache_shape, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    positions = torch.randint(0, MAX_POSITIONS, (rows,), generator=gen).cuda()
    slots = torch.randperm(cache_shape[0] * 16, generator=gen)[:rows].cuda()
    rotary = RotaryEmbedding(head_dim, MAX_POSITIONS, 1e6, None).to("cuda")
    with torch.device("cuda"):
        q_norm, k_norm = RMSNorm(head_dim, 1e-6).to(torch.bfloat16), \
            RMSNorm(head_dim, 1e-6).to(torch.bfloat16)
    expected_q = TorchAttentionBackend().rope_and_store(
        positions, q.clone(), k.clone(), v.clone(), caches[0], caches[1], slots, rotary,
        q_norm, k_norm, row_scale)
    out_q = TritonAttentionBackend().rope_and_store(
        positions, q, k, v, caches[2], caches[3], slots, rotary, q_norm, k_norm, row_scale)
    # RoPE's sums cancel: a near-zero output may differ by an ulp of its terms (~1-4 here).
    torch.testing.assert_close(out_q.float(), expected_q.float(), **BF16_ROTATED)
    torch.testing.assert_close(caches[2].float(), caches[0].float(), **BF16_ROTATED)
    torch.testing.assert_close(caches[3].float(), caches[1].float(), **BF16)
    factor = torch.rsqrt(residual.double().pow(2).mean(-1) + 1e-6)
    stored_v = caches[3].view(-1, kv_heads, head_dim)[slots].double()
    torch.testing.assert_close(stored_v, v.double() * factor[:, None, None], **BF16)


@pytest.mark.parametrize("num_tokens", [1, 16, 300, 2048])
def test_fused_experts_match_per_expert_loop(num_tokens):
    """Qwen3-30B-A3B's experts (128 of hidden 2048, intermediate 768, top-8): the grouped
    GEMMs, in decode's 16-row blocks and prefill's 64-row ones, against the CPU path's loop
    run on the GPU in float64, and inside a CUDA graph."""
    num_experts, top_k, hidden, inter = 128, 8, 2048, 768
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen).to("cuda", torch.bfloat16)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen).div(hidden ** 0.5)
    down = torch.randn(num_experts, hidden, inter, generator=gen).div(inter ** 0.5)
    gate_up, down = gate_up.to("cuda", torch.bfloat16), down.to("cuda", torch.bfloat16)
    probs = torch.softmax(torch.randn(num_tokens, num_experts, generator=gen), -1).to("cuda")
    weights, experts = torch.topk(probs, top_k, dim=-1)
    weights = weights.to(torch.bfloat16)
    expected = experts_loop(*(t.double() for t in (x, gate_up, down, weights)), experts)
    out = fused_experts(x, gate_up, down, weights, experts)
    torch.testing.assert_close(out.double(), expected, **BF16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_experts(x, gate_up, down, weights, experts)
    x.copy_(torch.randn(num_tokens, hidden, generator=gen).to("cuda", torch.bfloat16))
    experts.copy_(torch.roll(experts, 1, dims=0))  # new routing, replayed without capture
    graph.replay()
    expected = experts_loop(*(t.double() for t in (x, gate_up, down, weights)), experts)
    torch.testing.assert_close(captured.double(), expected, **BF16)


def test_route_top_k_matches_softmax_topk():
    gen = torch.Generator().manual_seed(5)
    # 0.05 apart in a random order per token: no ties in bf16, so the top 8 are unique.
    ranks = torch.stack([torch.randperm(128, generator=gen) for _ in range(300)])
    logits = (0.05 * ranks - 2.0).to("cuda", torch.bfloat16)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    expected_weights, expected_experts = torch.topk(probs, 8, dim=-1)
    expected_weights = expected_weights / expected_weights.sum(-1, keepdim=True)
    weights, experts = route_top_k(logits, 8, renormalise=True)
    assert torch.equal(experts.long(), expected_experts)
    torch.testing.assert_close(weights, expected_weights.to(torch.bfloat16), atol=1e-2, rtol=1e-2)
