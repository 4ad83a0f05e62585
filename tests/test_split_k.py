"""Split-K decode projections: the slicing views and the rule for when to split (CPU).

The batched GEMM itself needs CUDA (``bmm`` with a float32 output is CUDA-only); tests/gpu
checks the whole path against the unsplit one, and tests/kernels the norm that sums the parts.
"""
import pytest
import torch
import torch.nn.functional as F

from nanoserve.layers.split_k import (SPLIT_K_MAX_ROWS, split_k_partial_sums, split_k_parts,
                                      split_k_views)


@pytest.mark.parametrize("rows,parts", [(3, 2), (64, 4), (200, 3)])
def test_views_slice_k_without_copies(rows, parts):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen, dtype=torch.float64)
    w = torch.randn(40, 96, generator=gen, dtype=torch.float64)
    xs, ws = split_k_views(x, w, parts)
    assert xs.shape == (parts, rows, 96 // parts) and ws.shape == (parts, 96 // parts, 40)
    assert xs.data_ptr() == x.data_ptr() and ws.data_ptr() == w.data_ptr()
    torch.testing.assert_close(torch.bmm(xs, ws).sum(0), F.linear(x, w))
    torch.testing.assert_close(torch.bmm(xs, ws)[1], x[:, 96 // parts:2 * 96 // parts] @
                               w[:, 96 // parts:2 * 96 // parts].T)


def test_split_rule():
    assert split_k_parts(1, 1024, 2048) == 1  # batch 1 is the skinny GEMV's
    assert split_k_parts(2, 1024, 2048) == split_k_parts(128, 1024, 3072) == 4
    assert split_k_parts(129, 1024, 3072) == split_k_parts(SPLIT_K_MAX_ROWS, 1024, 2048) == 2
    assert split_k_parts(SPLIT_K_MAX_ROWS + 1, 1024, 2048) == 1  # prefill: cuBLAS unsplit
    assert split_k_parts(64, 4096, 4096) == 1  # wide outputs already fill the GPU
    assert split_k_parts(64, 1024, 1000) == 1  # 1000 / 4 slices would misalign 16-byte loads


def test_cpu_is_never_split():
    assert split_k_partial_sums(torch.randn(8, 64), torch.randn(32, 64), None) is None
