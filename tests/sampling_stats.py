"""A goodness-of-fit statistic shared by the sampler's and the sampling kernel's tests."""
import torch


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of token ``samples`` against ``probs``; fails if a token of
    probability 0 was drawn."""
    observed = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    support = expected > 0
    assert observed[~support].sum() == 0, "sampled a token of probability 0"
    return float(((observed[support] - expected[support]) ** 2 / expected[support]).sum())
