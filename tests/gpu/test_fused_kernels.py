"""On a CUDA device, at real shapes in bf16: the kernels that took over other ops' work (split
decode finishing the new tokens, the projection op's fusions: the folded pre-norm, SiLU-and-mul
and the residual add, on the skinny GEMV and on cuBLAS; the fused MoE experts) against the
PyTorch path they replace.
tests/kernels checks the same under the interpreter at small sizes. Skipped without CUDA.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # Before the kernels are imported: in one pytest process tests/kernels later sets
    # TRITON_INTERPRET=1, and kernels defined without it would not run under the interpreter.
    pytest.skip("needs a CUDA device", allow_module_level=True)

from nanoserve.attention.metadata import AttentionMetadata  # noqa: E402
from nanoserve.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from nanoserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from nanoserve.kernels.common import device_sm_count  # noqa: E402
from nanoserve.kernels.decode_attention import (  # noqa: E402
    SPLIT_DECODE_TUNING,
    NewTokens,
    decode_attention,
    num_decode_splits,
)
from nanoserve.kernels.fused_moe import fused_experts  # noqa: E402
from nanoserve.attention.mla_reference import mla_decode  # noqa: E402
from nanoserve.hf_deepseek import ExpertRouting  # noqa: E402
from nanoserve.kernels.mla_decode import mla_decode_attention  # noqa: E402
from nanoserve.kernels.moe_route import route_top_k  # noqa: E402
from nanoserve.layers.moe_router import GroupedRouter  # noqa: E402
from nanoserve.kernels.skinny_gemm import MAX_ROWS, select  # noqa: E402
from nanoserve.layers.activation import silu_and_mul_torch  # noqa: E402
from nanoserve.layers.linear import (  # noqa: E402
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from nanoserve.layers.moe import experts_loop  # noqa: E402
from nanoserve.layers.norm import RMSNorm, rms_norm_torch  # noqa: E402
from nanoserve.layers.rotary import RotaryEmbedding  # noqa: E402

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


@pytest.mark.parametrize("seq_lens", [[300], [4000, 17, 1, 900]], ids=["batch1", "batch4"])
@pytest.mark.parametrize("group", [2, 4], ids=["qwen3-0.6b", "qwen3-8b"])
@pytest.mark.parametrize("prefetch_kv", [True, False], ids=["prefetched", "in-loop"])
def test_split_decode_finishing_new_tokens_matches_torch_path(seq_lens, group, prefetch_kv):
    check_split_decode(seq_lens, group, 128, torch.bfloat16, "cuda", prefetch_kv=prefetch_kv)


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


# (hidden, heads, kv heads, head_dim, intermediate, qkv bias): Qwen3-0.6B's and Qwen3-8B's
# layers, and Qwen2.5-0.5B's (head_dim 64, a qkv bias, widths no tuning file names).
LAYER_SHAPES = {"qwen3-0.6b": (1024, 16, 8, 128, 3072, False),
                "qwen3-8b": (4096, 32, 8, 128, 12288, False),
                "qwen2.5-0.5b": (896, 14, 2, 64, 4864, True)}


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 16, 300])
@pytest.mark.parametrize("shape", sorted(LAYER_SHAPES))
def test_projection_fusions_match_float64(rows, shape):
    """A layer's projections as the decoder calls them on the GPU path: o_proj adding into the
    residual stream, gate/up applying the folded post-attention norm and writing silu * up,
    down adding in, qkv applying the folded input norm (and its bias). Whichever path the
    op's ``select`` picks (the skinny GEMV or cuBLAS with separate launches), each result is
    as close to float64 as the unfused bf16 launches are."""
    hidden, heads, kv_heads, head_dim, inter, bias = LAYER_SHAPES[shape]
    gen = torch.Generator().manual_seed(rows + hidden)

    def rand(*size, std=1.0):
        return (std * torch.randn(*size, generator=gen)).to("cuda", torch.bfloat16)

    with torch.device("cuda"):
        o_proj = RowParallelLinear(heads * head_dim, hidden).to(torch.bfloat16)
        gate_up = MergedColumnParallelLinear(hidden, [inter] * 2).to(torch.bfloat16)
        down = RowParallelLinear(inter, hidden).to(torch.bfloat16)
        qkv = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=bias).to(torch.bfloat16)
        norms = [RMSNorm(hidden, 1e-6).to(torch.bfloat16) for _ in range(2)]
    for layer in (o_proj, gate_up, down, qkv):
        fan_in = layer.weight.shape[1]
        layer.weight.data.copy_(rand(*layer.weight.shape, std=fan_in ** -0.5))
    if bias:
        qkv.bias.data.copy_(rand(*qkv.bias.shape))
    for norm in norms:
        norm.weight.data.copy_(rand(hidden, std=0.3) + 1)
    gammas = [norm.weight.double().clone() for norm in norms]

    def ref_linear(x, layer, normed_by=None):
        if normed_by is not None:
            x = rms_norm_torch(x, gammas[normed_by], 1e-6)
        out = x @ layer.weight.double().T
        return out if layer.bias is None else out + layer.bias.double()

    def unfused_linear(x, layer, normed_by=None):  # the bf16 launches the fusions replace
        if normed_by is not None:
            x = rms_norm_torch(x, norms[normed_by].weight, 1e-6)
        return F.linear(x, layer.weight, layer.bias)

    attn = rand(rows, heads * head_dim)
    residual = rand(rows, hidden, std=4.0) * torch.logspace(-0.3, 0.9, rows)[:, None].to(
        "cuda", torch.bfloat16)
    want_h1 = residual.double() + ref_linear(attn.double(), o_proj)
    want_act = silu_and_mul_torch(ref_linear(want_h1, gate_up, 1))
    unfused_h1 = residual + unfused_linear(attn, o_proj)
    unfused_act = silu_and_mul_torch(unfused_linear(unfused_h1, gate_up, 1))
    unfused_h2 = unfused_h1 + unfused_linear(unfused_act, down)
    unfused_qkv = unfused_linear(unfused_h2, qkv, 0)

    gate_up.fold_norm(norms[1])
    qkv.fold_norm(norms[0])
    h1 = o_proj(attn, residual=residual.clone())
    act = gate_up(h1, norm=norms[1], activate=True)
    h2 = down(act, residual=h1.clone())
    out = qkv(h2, norm=norms[0])
    want_h2 = h1.double() + ref_linear(act.double(), down)
    want_qkv = ref_linear(h2.double(), qkv, 0)
    for got, want, unfused in ((h1, want_h1, unfused_h1), (act, want_act, unfused_act),
                               (h2, want_h2, unfused_h2), (out, want_qkv, unfused_qkv)):
        # Across many outputs either path has a few past any fixed bf16 tolerance: the mean
        # error decides, the worst only bounds the outliers (a lost or wrong factor moves both
        # by far more).
        error, unfused_error = (got.double() - want).abs(), (unfused.double() - want).abs()
        assert error.mean() <= 1.25 * unfused_error.mean() + 1e-6
        assert error.max() <= 2 * unfused_error.max() + 1e-3
    # One row always takes the skinny GEMV, more than it serves never do (2-8: as the
    # device's tuning file says).
    chosen = select(rows, *o_proj.weight.shape, o_proj.weight.device)
    assert chosen is not None if rows == 1 else chosen is None if rows > MAX_ROWS else True


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


@pytest.mark.parametrize("num_tokens", [1, 300])
def test_grouped_router_on_cuda_matches_its_cpu_path(num_tokens):
    """DeepSeek-V2's routing (160 experts in 8 groups, 3 kept, top 6): the layer on CUDA
    (float32 logits, then one kernel) against its PyTorch path on the CPU, on bf16 rows whose
    logits are 0.05 apart."""
    gen = torch.Generator().manual_seed(num_tokens)
    hidden, num_experts = 5120, 160
    columns = torch.randperm(hidden, generator=gen)[:num_experts]
    router = GroupedRouter(hidden, num_experts, 6,
                           ExpertRouting(n_group=8, topk_group=3, scaling=16.0))
    router.weight.zero_()
    router.weight[torch.arange(num_experts), columns] = 1.0
    x = torch.rand(num_tokens, hidden, generator=gen) - 0.5
    ranks = torch.stack([torch.randperm(num_experts, generator=gen) for _ in range(num_tokens)])
    x[:, columns] = 0.05 * ranks - 4.0  # over 3 bf16 steps apart: still distinct
    x = x.to(torch.bfloat16)
    want_weights, want_experts = router(x)
    weights, experts = router.cuda()(x.cuda())
    order, want_order = experts.long().cpu().sort(-1), want_experts.sort(-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.cpu().gather(1, order.indices),
                               want_weights.gather(1, want_order.indices))


@pytest.mark.parametrize("seq_lens,num_splits", [([700], None), ([1, 37, 2100, 260], None),
                                                 ([513, 64], 1)])
def test_latent_decode_matches_reference(seq_lens, num_splits):
    """DeepSeek-V2-Lite's MLA decode (16 heads, latent 512, rope 64) through the split kernel
    against the PyTorch absorbed form in float64, the block tables column-major as the decode
    graphs hold them."""
    gen = torch.Generator().manual_seed(len(seq_lens))
    heads, nope, rope, rank, v_dim, block = 16, 128, 64, 512, 128, 16
    blocks_per_seq = -(-max(seq_lens) // block)
    tables = torch.randperm(len(seq_lens) * blocks_per_seq, generator=gen).view(
        len(seq_lens), blocks_per_seq).to(torch.int32)
    cache = torch.randn(tables.numel(), block, 1, rank + rope, generator=gen).to(torch.bfloat16)
    b = len(seq_lens)
    meta = AttentionMetadata(torch.arange(b + 1, dtype=torch.int32),
                             torch.tensor(seq_lens, dtype=torch.int32),
                             torch.full((b,), -1, dtype=torch.int64), tables, 1, max(seq_lens))
    q_nope = torch.randn(b, heads, nope, generator=gen).to(torch.bfloat16)
    q_rope = torch.randn(b, heads, rope, generator=gen).to(torch.bfloat16)
    kv_b = (torch.randn(heads * (nope + v_dim), rank, generator=gen) * 0.05).to(torch.bfloat16)
    want = mla_decode(*(t.double() for t in (q_nope, q_rope, cache)), meta, kv_b.double(),
                      v_dim, 0.07)
    graph_tables = tables.T.contiguous().T.cuda()  # [B, width], column-major
    got = mla_decode_attention(q_nope.cuda(), q_rope.cuda(), cache.cuda(), graph_tables,
                               meta.seq_lens.cuda(), meta.query_start_loc.cuda(), max(seq_lens),
                               kv_b.cuda(), v_dim, 0.07, num_splits=num_splits)
    torch.testing.assert_close(got.double().cpu(), want, **BF16)
