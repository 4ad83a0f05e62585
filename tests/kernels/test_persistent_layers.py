"""The persistent batch-1 decode kernel's arithmetic against a float64 PyTorch decoder stack,
on the CPU interpreter, which runs it phase by phase (kernel boundaries as the barriers).
tests/gpu runs the persistent launch, barriers and all, against the same reference."""
import os

# Must precede any triton import: the kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from decode_stack import SMALL_TILES, run_case  # noqa: E402


@pytest.mark.parametrize("seq_len", [1, 7, 37, 70])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_matches_float64_reference(seq_len: int, qk_norm: bool):
    torch.manual_seed(seq_len)
    h, expected, caches, ref_caches = run_case(seq_len, qk_norm, SMALL_TILES, torch.float32,
                                               "cpu")
    torch.testing.assert_close(h.double(), expected, rtol=1e-4, atol=1e-4)
    for cache, ref in zip(caches, ref_caches):
        torch.testing.assert_close(cache.double(), ref, rtol=1e-4, atol=1e-4)


def test_one_split_and_padded_widths():
    """One split (no merge across splits); hidden, heads and inter not powers of two."""
    torch.manual_seed(1)
    tiles = SMALL_TILES._replace(num_splits=1)
    h, expected, _, _ = run_case(21, True, tiles, torch.float32, "cpu", hidden=48, heads=6,
                                 kv_heads=3, inter=40)
    torch.testing.assert_close(h.double(), expected, rtol=1e-4, atol=1e-4)

