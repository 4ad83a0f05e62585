"""A goodness-of-fit statistic shared by the sampler's and the sampling kernel's tests, and the
sampler's first pass as the batch-1 layer kernel does it (its rules in PyTorch)."""
import math

import torch

LOG2E = math.log2(math.e)


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of token ``samples`` against ``probs``; fails if a token of
    probability 0 was drawn."""
    observed = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    support = expected > 0
    assert observed[~support].sum() == 0, "sampled a token of probability 0"
    return float(((observed[support] - expected[support]) ** 2 / expected[support]).sum())


def tile_stats_reference(logits: torch.Tensor, temperature: torch.Tensor,
                         tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tile_max, tile_sum, tile_arg), [rows, ceil(V / tile)] each, by the rules of
    ``nanoserve.kernels.sampling.TileStats``: greedy rows (temperature 0) get each tile's largest
    logit and its lowest index and a sum of 0; temperature rows each tile's largest score
    ``x * (log2(e) / T)`` (float32) and its sum of ``2^(score - largest)``, and the tile's
    first index. NaN counts as -inf."""
    rows, vocab = logits.shape
    tiles = -(-vocab // tile)
    x = logits.float().nan_to_num(nan=float("-inf"), posinf=float("inf"))
    x = torch.cat([x, x.new_full((rows, tiles * tile - vocab), float("-inf"))], 1)
    x = x.view(rows, tiles, tile)
    first = torch.arange(tiles, device=x.device) * tile
    top = x.max(-1).values
    arg = first + (x == top[..., None]).int().argmax(-1)
    scale = torch.tensor(LOG2E, dtype=torch.float32, device=x.device) / temperature.float()
    scores = (x * scale[:, None, None]).clamp(max=torch.finfo(torch.float32).max)
    score_top = scores.max(-1).values
    finite_top = torch.where(score_top == float("-inf"), 0.0, score_top)
    mass = torch.exp2(scores - finite_top[..., None]).sum(-1)
    greedy = (temperature == 0)[:, None]
    return (torch.where(greedy, top, score_top), torch.where(greedy, 0.0, mass),
            torch.where(greedy, arg, first.expand(rows, -1)).int())
