"""The MLA decode path through the Triton decode kernel against the PyTorch reference (the
absorbed form over the same paged latent cache), on the CPU interpreter."""
import os

# Must precede any triton import: the kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nanoserve.attention.metadata import AttentionMetadata  # noqa: E402
from nanoserve.attention.mla_reference import (mla_decode, mla_prefill,  # noqa: E402
                                               rope_and_norm, store_latent)
from nanoserve.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from nanoserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from nanoserve.kernels.mla_decode import (MlaDecodeConfig, mla_decode_attention,  # noqa: E402
                                          rope_store_latent)
from nanoserve.layers.norm import RMSNorm  # noqa: E402
from nanoserve.layers.rotary import rope_cos_sin  # noqa: E402

GARBAGE = 1e3  # cache rows no sequence owns: a kernel reading them lands far off


@pytest.mark.parametrize("num_splits,column_major,heads,config", [
    (1, False, 4, None), (3, False, 4, None), (3, True, 4, None),
    # launches other than select's, as the tuner tries them
    (None, False, 20, MlaDecodeConfig(3, 32, 16, 8, 2)),  # 32-head blocks over 20 heads
    (None, False, 20, MlaDecodeConfig(None, 16, 32, 4, 3)),  # the last head block part empty
    (None, False, 4, MlaDecodeConfig(1, 16, 64, 8, 2)),  # one tile spans whole contexts
    (2, False, 4, MlaDecodeConfig(1, block_n=16)),  # num_splits overrides the config's
])
def test_mla_decode_kernel_matches_reference(num_splits, column_major, heads, config):
    """Row-major block tables (a step's) and column-major ones (the decode graphs' arena)."""
    gen = torch.Generator().manual_seed(0)
    nope, rope, rank, v_dim, block = 8, 8, 24, 6, 4
    seq_lens = [5, 13, 1, 9]
    tables = torch.tensor([[2, 7, 0, 0], [1, 4, 5, 8], [3, 0, 0, 0], [6, 9, 10, 0]],
                          dtype=torch.int32)
    if column_major:
        tables = tables.T.contiguous().T
    cache = torch.full((11, block, 1, rank + rope), GARBAGE)
    for i, n in enumerate(seq_lens):
        pos = torch.arange(n)
        rows = cache.view(-1, rank + rope)
        rows[tables[i, pos // block].long() * block + pos % block] = torch.randn(
            n, rank + rope, generator=gen)
    b = len(seq_lens)
    meta = AttentionMetadata(torch.arange(b + 1, dtype=torch.int32),
                             torch.tensor(seq_lens, dtype=torch.int32),
                             torch.full((b,), -1, dtype=torch.int64), tables, 1, max(seq_lens))
    q_nope = torch.randn(b, heads, nope, generator=gen)
    q_rope = torch.randn(b, heads, rope, generator=gen)
    kv_b = torch.randn(heads * (nope + v_dim), rank, generator=gen) * 0.3
    got = mla_decode_attention(q_nope, q_rope, cache, tables, meta.seq_lens,
                               meta.query_start_loc, max(seq_lens), kv_b, v_dim, 0.2,
                               num_splits=num_splits, config=config)
    want = mla_decode(q_nope, q_rope, cache, meta, kv_b, v_dim, 0.2)
    assert got.shape == (b, heads, v_dim)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    # and the decompressed form agrees: the reference is the attention it claims to be
    torch.testing.assert_close(mla_prefill(q_nope, q_rope, cache, meta, kv_b, v_dim, 0.2), want,
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_latent_matches_reference_and_skips_padding(dtype):
    """The one kernel against the reference's rotation, norm and store: rotated queries and
    cache rows (from strided projection outputs); slots of -1 store nothing."""
    gen = torch.Generator().manual_seed(1)
    heads, nope, rope, rank = 3, 8, 8, 24
    tokens = 6
    q = torch.randn(tokens, heads, nope + rope, generator=gen).to(dtype)
    kv = torch.randn(tokens, 2, rank + rope, generator=gen).to(dtype)[:, 0]  # strided rows
    positions = torch.tensor([0, 5, 17, 3, 40, 9])
    cos_sin = rope_cos_sin(rope, 64, 1e4, None)
    norm = RMSNorm(rank, 1e-6).to(dtype)
    norm.weight.copy_(torch.rand(rank, generator=gen) + 0.5)
    slots = torch.tensor([3, -1, 17, 0, -1, 9])
    want = torch.full((5, 4, 1, rank + rope), GARBAGE, dtype=dtype)
    got = want.clone()
    _, want_q, latent, k_rope = rope_and_norm(q, kv, positions, cos_sin, norm)
    store_latent(latent, k_rope, want, slots)
    got_q = rope_store_latent(q, kv, positions, cos_sin, norm.weight, norm.eps, got, slots)
    # float32: torch.rms_norm sums in its own order, a rounding apart
    close = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else {}
    torch.testing.assert_close(got, want, **close)
    torch.testing.assert_close(got_q, want_q, **close)
    with pytest.raises(ValueError, match="cache rows"):
        rope_store_latent(q, kv[:, :rank], positions, cos_sin, norm.weight, norm.eps, got,
                          slots)


@pytest.mark.parametrize("decode_only", [True, False])
def test_triton_backend_mla_attention_matches_torch_backend(decode_only):
    """The GPU backend's whole MLA step (store, then absorbed decode or decompressed prefill)
    against the PyTorch backend's on the same inputs and cache."""
    gen = torch.Generator().manual_seed(2)
    heads, nope, rope, rank, v_dim, block = 4, 8, 8, 24, 6, 4
    tables = torch.tensor([[2, 7, 0], [1, 4, 5], [3, 6, 8]], dtype=torch.int32)
    seq_lens = [6, 11, 3]
    new = [1, 1, 1] if decode_only else [2, 5, 3]  # the third sequence's whole prompt
    cache = torch.full((9, block, 1, rank + rope), GARBAGE)
    rows = cache.view(-1, rank + rope)
    slots = []
    for i, (n, q) in enumerate(zip(seq_lens, new)):
        pos = torch.arange(n)
        flat = tables[i, pos // block].long() * block + pos % block
        rows[flat[:n - q]] = torch.randn(n - q, rank + rope, generator=gen)
        slots += flat[n - q:].tolist()
    t = sum(new)
    starts = torch.tensor([0] + new, dtype=torch.int32).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(starts, torch.tensor(seq_lens, dtype=torch.int32),
                             torch.tensor(slots, dtype=torch.int64), tables, max(new),
                             max(seq_lens))
    assert meta.decode_only == decode_only
    q = torch.randn(t, heads, nope + rope, generator=gen)
    kv = torch.randn(t, rank + rope, generator=gen)
    positions = torch.tensor([n - q_len + j for n, q_len in zip(seq_lens, new)
                              for j in range(q_len)])
    norm = RMSNorm(rank, 1e-6)
    norm.weight.copy_(torch.rand(rank, generator=gen) + 0.5)
    args = (q, kv, positions, rope_cos_sin(rope, 32, 1e4, None), norm)
    kv_b = torch.randn(heads * (nope + v_dim), rank, generator=gen) * 0.3
    want_cache, got_cache = cache.clone(), cache.clone()
    want = TorchAttentionBackend().mla_attention(*args, want_cache, meta, kv_b, v_dim, 0.2)
    got = TritonAttentionBackend().mla_attention(*args, got_cache, meta, kv_b, v_dim, 0.2)
    torch.testing.assert_close(got_cache, want_cache, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_engine_on_the_triton_backend_gives_the_torch_backends_tokens(tokenizer_dir, tmp_path,
                                                                      monkeypatch):
    """A whole tiny DeepSeek-V2 engine whose layers attend through the Triton backend (its
    kernels interpreted) against the same engine on the PyTorch backend: prompts longer than a
    prefill chunk, four sequences decoding together in the kernels' longest-first order."""
    import random

    from reference import greedy_on_both_backends
    from test_deepseek_v2 import CASES, hf_config
    from test_model_breadth import save_random
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    path = save_random(hf_config(len(tok), tok.eos_token_id, **CASES["plain-q"]), tmp_path,
                       tokenizer_dir)
    rng = random.Random(0)
    prompts = [[rng.randint(1, 60) for _ in range(n)] for n in (5, 70, 150, 33)]

    want, got = greedy_on_both_backends(path, prompts, 12, monkeypatch, max_num_seqs=4,
                                        max_num_batched_tokens=64)
    assert got == want
