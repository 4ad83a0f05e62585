"""The MLA decode path through the Triton decode kernel against the PyTorch reference (the
absorbed form over the same paged latent cache), on the CPU interpreter."""
import os

# Must precede any triton import: the kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nanoserve.attention.metadata import AttentionMetadata  # noqa: E402
from nanoserve.attention.mla_reference import mla_decode, mla_prefill  # noqa: E402
from nanoserve.kernels.mla_decode import mla_decode_attention  # noqa: E402

GARBAGE = 1e3  # cache rows no sequence owns: a kernel reading them lands far off


@pytest.mark.parametrize("num_splits", [1, 3])
def test_mla_decode_kernel_matches_reference(num_splits):
    gen = torch.Generator().manual_seed(0)
    heads, nope, rope, rank, v_dim, block = 4, 8, 8, 24, 6, 4
    seq_lens = [5, 13, 1, 9]
    tables = torch.tensor([[2, 7, 0, 0], [1, 4, 5, 8], [3, 0, 0, 0], [6, 9, 10, 0]],
                          dtype=torch.int32)
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
                               num_splits=num_splits)
    want = mla_decode(q_nope, q_rope, cache, meta, kv_b, v_dim, 0.2)
    assert got.shape == (b, heads, v_dim)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    # and the decompressed form agrees: the reference is the attention it claims to be
    torch.testing.assert_close(mla_prefill(q_nope, q_rope, cache, meta, kv_b, v_dim, 0.2), want,
                               atol=2e-5, rtol=1e-4)
