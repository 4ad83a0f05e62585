"""On a CUDA device, at Qwen3's vocabulary in bf16: the fused sampling kernel's greedy rows
against ``torch.argmax`` and its temperature draws against ``softmax(logits / T)``.
tests/kernels checks the same under the interpreter with small tiles. Skipped without CUDA.
"""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    # Before the kernel is imported: in one pytest process tests/kernels later sets
    # TRITON_INTERPRET=1, and kernels defined without it would not run under the interpreter.
    pytest.skip("needs a CUDA device", allow_module_level=True)

from nanoserve.kernels.sampling import TILE, sample_tokens  # noqa: E402
from sampling_stats import chi_square  # noqa: E402

VOCAB = 151936


@pytest.mark.parametrize("batch", [1, 37, 256])
def test_greedy_rows_are_argmax_and_sampled_rows_differ(batch):
    gen = torch.Generator(device="cuda").manual_seed(batch)
    logits = torch.randn(batch, VOCAB, generator=gen, device="cuda").to(torch.bfloat16)
    # 156 ties across tiles, 12 above the rest: greedy takes the lowest index, and draws land
    # on them but rarely on the first (the rest hold ~1e-6 of the mass at T = 0.8).
    logits[:, ::977] = logits.max() + 12
    greedy = sample_tokens(logits, torch.zeros(batch, device="cuda"), seed=0)
    assert torch.equal(greedy, logits.argmax(-1))
    mixed = torch.where(torch.arange(batch, device="cuda") % 2 == 0, 0.0, 0.8)
    drawn = sample_tokens(logits, mixed, seed=3)
    assert torch.equal(drawn[::2], greedy[::2])
    assert torch.equal(drawn, sample_tokens(logits, mixed, seed=3))
    if batch > 1:
        assert (drawn[1::2] != greedy[1::2]).any()
        assert (logits.gather(1, drawn[:, None]) == logits.max()).all()


def test_draws_over_tiles_follow_softmax():
    """100k draws from a row whose mass sits in 12 tokens of different tiles, one of them
    ~90 log-units above the others' tiles' scale: chi-square against the softmax."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, temperature = 100_000, 0.6
    row = torch.randn(VOCAB, generator=gen, device="cuda") - 60
    where = torch.arange(12, device="cuda") * (VOCAB // 12) + TILE // 3
    row[where] = torch.randn(12, generator=gen, device="cuda")
    row = row.to(torch.bfloat16)
    probs = (row.float() / temperature).softmax(-1)
    drawn = sample_tokens(row.expand(rows, VOCAB), torch.full((rows,), temperature,
                                                             device="cuda"), seed=99)
    # 11 degrees of freedom for the 12 tokens; the rest hold ~e^-100 of the mass.
    assert chi_square(drawn.cpu(), probs.cpu()) < 31.26
    assert chi_square(drawn.cpu(), (row.float() / (1.5 * temperature)).softmax(-1).cpu()) > 31.26
