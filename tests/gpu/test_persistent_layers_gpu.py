"""The persistent batch-1 decode kernel on a CUDA device, barriers and all, against the float64
PyTorch decoder stack (tests/decode_stack.py). Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from decode_stack import SMALL_TILES, run_case  # noqa: E402
from persistent_layers import LayerTiles  # noqa: E402


@pytest.mark.parametrize("seq_len", [1, 37, 300])
def test_persistent_launch_matches_reference(seq_len: int):
    """Barriers and all: fp32 at the small shape, three programs looping over many tiles."""
    torch.manual_seed(seq_len)
    h, expected, caches, ref_caches = run_case(seq_len, True, SMALL_TILES, torch.float32,
                                               "cuda", persistent=True)
    torch.testing.assert_close(h.double().cpu(), expected, rtol=1e-4, atol=1e-4)
    for cache, ref in zip(caches, ref_caches):
        torch.testing.assert_close(cache.double().cpu(), ref, rtol=1e-4, atol=1e-4)


def test_persistent_launch_at_qwen3_width():
    """bf16 at Qwen3-0.6B's layer shape, one program per SM with the default tiles."""
    torch.manual_seed(0)
    h, expected, _, _ = run_case(200, True, LayerTiles(), torch.bfloat16, "cuda", hidden=1024,
                                 heads=16, kv_heads=8, head_dim=128, inter=3072, num_layers=3,
                                 block_size=16, persistent=True)
    error = (h.double().cpu() - expected).norm() / expected.norm()
    assert error < 2e-2, f"relative error {error:.3g}"
