"""Fused q/k norm + RoPE + KV store against the PyTorch composition, on the CPU interpreter."""
import os

# Must precede any triton import: the kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nanoserve.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from nanoserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from nanoserve.kernels.qk_norm_rope import (  # noqa: E402
    QkNormRopeConfig,
    candidates,
    heuristic_config,
    qk_norm_rope_store,
)
from nanoserve.layers.norm import RMSNorm, rms_norm_torch  # noqa: E402
from nanoserve.layers.rotary import RotaryEmbedding, rotary_embedding_torch  # noqa: E402

# fp32 differs from PyTorch only by summation order and rsqrt rounding; 16-bit outputs may flip
# one ulp where the fp32 value sits near a rounding boundary (see test_fused_ops.py).
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-3, rtol=2e-3)}
MAX_DIFFERENT_FRACTION = 0.01
EPS = 1e-6
MAX_POSITIONS = 4096
BLOCK_SIZE = 16
NUM_BLOCKS = 4


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Close to the reference; in fp16 also bit-identical almost everywhere (rounding order)."""
    torch.testing.assert_close(actual, expected, **TOLERANCE[expected.dtype])
    if expected.dtype == torch.float16:
        assert (actual != expected).float().mean().item() <= MAX_DIFFERENT_FRACTION


def make_inputs(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """A fused qkv output with its q/k/v views, positions, shuffled slots (two -1) and caches."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (2 * torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim,
                           generator=gen)).to(dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=gen)
    positions[0], positions[1] = 0, MAX_POSITIONS - 1
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:num_tokens]
    slots[[1, 4]] = -1  # padding tokens own no slot
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    return dict(
        qkv=qkv, q=q.view(-1, num_heads, head_dim), k=k.view(-1, num_kv_heads, head_dim),
        v=v.view(-1, num_kv_heads, head_dim), positions=positions, slots=slots,
        k_cache=torch.randn(cache_shape, generator=gen).to(dtype),
        v_cache=torch.randn(cache_shape, generator=gen).to(dtype),
        q_weight=(1 + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype),
        k_weight=(1 + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype),
    )


def reference(inp: dict[str, torch.Tensor], cos_sin: torch.Tensor, qk_norm: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rms_norm_torch per head, rotary_embedding_torch, then a scatter into copies of the caches."""
    q, k = inp["q"], inp["k"]
    if qk_norm:
        q, k = rms_norm_torch(q, inp["q_weight"], EPS), rms_norm_torch(k, inp["k_weight"], EPS)
    q, k = rotary_embedding_torch(inp["positions"], q, k, cos_sin)
    k_cache, v_cache = inp["k_cache"].clone(), inp["v_cache"].clone()
    valid = inp["slots"] >= 0
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim)[inp["slots"][valid]] = k[valid]
    v_cache.view(-1, num_kv_heads, head_dim)[inp["slots"][valid]] = inp["v"][valid]
    return q, k_cache, v_cache


@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "norm+rope"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [
    (4, 1, 64), (2, 2, 128), (2, 4, 64), (1, 8, 128), (3, 2, 80),
])
def test_matches_torch_composition(qk_norm, dtype, num_kv_heads, group, head_dim):
    inp = make_inputs(7, num_kv_heads * group, num_kv_heads, head_dim, dtype, seed=head_dim + group)
    cos_sin = RotaryEmbedding(head_dim, MAX_POSITIONS, 1e6, None).cos_sin
    expected_q, expected_k_cache, expected_v_cache = reference(inp, cos_sin, qk_norm)
    kv_before = inp["qkv"][:, inp["q"][0].numel():].clone()
    k_cache, v_cache = inp["k_cache"], inp["v_cache"]

    weights = (inp["q_weight"], inp["k_weight"], EPS) if qk_norm else ()
    out = qk_norm_rope_store(inp["positions"], inp["q"], inp["k"], inp["v"], cos_sin,
                             k_cache, v_cache, inp["slots"], *weights)

    assert out is inp["q"]  # rotated in place, inside the fused qkv buffer
    assert_matches(inp["q"], expected_q)
    assert torch.equal(inp["qkv"][:, inp["q"][0].numel():], kv_before)  # k and v untouched
    # Written slots match; every other slot, including the padding tokens', keeps its value.
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    written[inp["slots"][inp["slots"] >= 0]] = True
    flat = (-1, num_kv_heads, head_dim)
    assert_matches(k_cache.view(flat)[written], expected_k_cache.view(flat)[written])
    assert torch.equal(k_cache.view(flat)[~written], expected_k_cache.view(flat)[~written])
    assert torch.equal(v_cache, expected_v_cache)


def test_a_candidate_launch_computes_the_same():
    """A tuner times each candidate launch: a non-default one computes the op too."""
    config = QkNormRopeConfig(num_warps=16)
    assert config in candidates(4, 2, 64) and config != heuristic_config(4, 2, 64)
    inp = make_inputs(7, 4, 2, 64, torch.float16, seed=5)
    cos_sin = RotaryEmbedding(64, MAX_POSITIONS, 1e6, None).cos_sin
    expected_q, expected_k_cache, expected_v_cache = reference(inp, cos_sin, qk_norm=True)
    qk_norm_rope_store(inp["positions"], inp["q"], inp["k"], inp["v"], cos_sin, inp["k_cache"],
                       inp["v_cache"], inp["slots"], inp["q_weight"], inp["k_weight"], EPS,
                       config=config)
    assert_matches(inp["q"], expected_q)
    assert_matches(inp["k_cache"], expected_k_cache)
    assert torch.equal(inp["v_cache"], expected_v_cache)


def test_empty_batch():
    """A zero-token step launches nothing."""
    cos_sin = RotaryEmbedding(64, 16, 1e4, None).cos_sin
    q, kv = torch.empty(0, 4, 64), torch.empty(0, 2, 64)
    cache = torch.zeros(1, BLOCK_SIZE, 2, 64)
    empty = torch.empty(0, dtype=torch.int64)
    out = qk_norm_rope_store(empty, q, kv, kv, cos_sin, cache, cache.clone(), empty)
    assert out.shape == (0, 4, 64) and not cache.any()


@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "norm+rope"])
def test_triton_backend_matches_torch_backend(qk_norm):
    """The two backends' rope_and_store, fed the model's modules, agree (fp16)."""
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    inp = make_inputs(6, num_heads, num_kv_heads, head_dim, torch.float16, seed=11)
    rotary = RotaryEmbedding(head_dim, MAX_POSITIONS, 1e4, None)
    norms: tuple[RMSNorm | None, RMSNorm | None] = (None, None)
    if qk_norm:
        norms = (RMSNorm(head_dim, EPS).half(), RMSNorm(head_dim, EPS).half())
        norms[0].weight.data.copy_(inp["q_weight"])
        norms[1].weight.data.copy_(inp["k_weight"])
    torch_caches = (inp["k_cache"].clone(), inp["v_cache"].clone())
    q_copy, k_copy, v_copy = inp["q"].clone(), inp["k"].clone(), inp["v"].clone()

    expected_q = TorchAttentionBackend().rope_and_store(
        inp["positions"], q_copy, k_copy, v_copy, *torch_caches, inp["slots"], rotary, *norms)
    q = TritonAttentionBackend().rope_and_store(
        inp["positions"], inp["q"], inp["k"], inp["v"], inp["k_cache"], inp["v_cache"],
        inp["slots"], rotary, *norms)

    assert_matches(q, expected_q)
    assert_matches(inp["k_cache"], torch_caches[0])
    assert torch.equal(inp["v_cache"], torch_caches[1])
