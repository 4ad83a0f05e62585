"""Sampler tests: each stage against a plain per-row reference, and the draws' statistics."""
from __future__ import annotations

import pytest
import torch

from nanoserve.runner.sampler import Sampler, apply_penalties, filter_logits
from nanoserve.runner.sampling_tensors import SamplingTensors
from nanoserve.sampling_params import SamplingParams
from sampling_stats import chi_square

CPU = torch.device("cpu")
V = 64


def build(params: list[SamplingParams], vocab_size: int = V, prompts=None, outputs=None,
          banned=None, generators=None) -> SamplingTensors:
    n = len(params)
    return SamplingTensors.build(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        banned if banned is not None else [[] for _ in range(n)],
        generators if generators is not None else [None] * n,
        vocab_size, CPU)


def random_logits(rows: int, vocab_size: int = V, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab_size, generator=gen) * 3.0


def random_tokens(count: int, vocab_size: int = V, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count,), generator=gen).tolist()


# ---- plain, one-row-at-a-time references -------------------------------------------------

def reference_penalties(row: torch.Tensor, p: SamplingParams, prompt: list[int],
                        output: list[int]) -> torch.Tensor:
    out = row.clone()
    for t in set(prompt) | set(output):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(output):
        out[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return out


def reference_kept(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Which tokens survive temperature + top-k + top-p + min-p, by the textbook definitions."""
    scaled = row / p.temperature
    keep = torch.ones(row.numel(), dtype=torch.bool)
    if p.top_k > 0:
        keep = torch.zeros_like(keep)
        keep[scaled.topk(min(p.top_k, row.numel())).indices] = True
    if p.top_p < 1.0:
        probs = scaled.masked_fill(~keep, float("-inf")).softmax(-1).tolist()
        nucleus = torch.zeros_like(keep)
        mass = 0.0
        for i in sorted(range(row.numel()), key=lambda i: -probs[i]):
            nucleus[i] = True
            mass += probs[i]
            if mass >= p.top_p:
                break
        keep = nucleus
    if p.min_p > 0.0:
        probs = scaled.masked_fill(~keep, float("-inf")).softmax(-1)
        keep &= probs >= p.min_p * probs.max()
    return keep


def check_filters(params: list[SamplingParams], seed: int) -> None:
    logits = random_logits(len(params), seed=seed)
    filtered = filter_logits(logits, build(params))
    for i, p in enumerate(params):
        keep = reference_kept(logits[i], p)
        assert torch.equal(torch.isfinite(filtered[i]), keep), f"row {i}: {p}"
        expected = (logits[i] / p.temperature).masked_fill(~keep, float("-inf")).softmax(-1)
        torch.testing.assert_close(filtered[i].softmax(-1), expected)


# ---- penalties ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["repetition", "frequency", "presence", "all"])
def test_penalties_match_reference(kind: str) -> None:
    settings = {
        "repetition": [dict(repetition_penalty=1.3), dict(repetition_penalty=0.7), {}],
        "frequency": [dict(frequency_penalty=0.8), dict(frequency_penalty=-1.5), {}],
        "presence": [dict(presence_penalty=1.2), dict(presence_penalty=-0.4), {}],
        "all": [dict(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.3),
                dict(repetition_penalty=1.1, presence_penalty=-2.0), {}],
    }[kind]
    params = [SamplingParams(**s) for s in settings]
    prompts = [random_tokens(20, seed=i) for i in range(len(params))]
    outputs = [random_tokens(5 + 7 * i, seed=100 + i) for i in range(len(params))]
    logits = random_logits(len(params), seed=1)
    got = apply_penalties(logits, build(params, prompts=prompts, outputs=outputs))
    for i, p in enumerate(params):
        torch.testing.assert_close(got[i], reference_penalties(logits[i], p, prompts[i],
                                                               outputs[i]))


def test_penalty_histories_sent_only_when_used() -> None:
    plain = build([SamplingParams()], prompts=[[1, 2]], outputs=[[3]])
    assert plain.prompt_tokens is None and plain.output_tokens is None
    counted = build([SamplingParams(presence_penalty=1.0)], prompts=[[1, 2]], outputs=[[3]])
    assert counted.prompt_tokens is None and counted.output_tokens.tolist() == [[3]]
    both = build([SamplingParams(repetition_penalty=1.2), SamplingParams()],
                 prompts=[[1, 2, 5], [4]], outputs=[[3], [6, 7]])
    assert both.prompt_tokens.tolist() == [[1, 2, 5], [V, V, V]]
    assert both.output_tokens.tolist() == [[3], [V]]


# ---- temperature and filters --------------------------------------------------------------

def test_top_k_matches_reference() -> None:
    params = [SamplingParams(top_k=k, temperature=t)
              for k, t in [(1, 1.0), (5, 0.5), (20, 2.0), (0, 1.0), (-1, 0.7), (V + 10, 1.0)]]
    tensors = build(params)
    assert tensors.max_top_k == 20 and not tensors.any_top_p
    check_filters(params, seed=2)


def test_top_p_matches_reference() -> None:
    params = [SamplingParams(top_p=p, temperature=t)
              for p, t in [(0.1, 1.0), (0.5, 0.8), (0.9, 1.5), (0.99, 1.0), (1.0, 1.0)]]
    check_filters(params, seed=3)


def test_top_p_below_float32_keeps_the_top_token() -> None:
    """A top_p that float32 rounds to 0 (legal: it is > 0) keeps the likeliest token alone,
    never cuts every token (the draw then fell to token 0)."""
    params = [SamplingParams(top_p=5e-324), SamplingParams(top_p=1e-45, top_k=3)]
    logits = random_logits(2, seed=7)
    kept = filter_logits(logits, build(params)) > float("-inf")
    assert kept.sum(-1).tolist() == [1, 1]
    assert kept.float().argmax(-1).tolist() == logits.argmax(-1).tolist()


def test_extreme_repetition_penalties_keep_logits_finite() -> None:
    """A penalty of float32's largest (or smallest) value leaves a seen token's logit finite,
    and a masked one -inf: an allowed token never becomes impossible or certain."""
    logits = torch.tensor([[-1.0, 2.0, float("-inf"), 0.5, 0.0]] * 2)
    params = [SamplingParams(repetition_penalty=3.4028235677973366e38),
              SamplingParams(repetition_penalty=1e-45)]
    out = apply_penalties(logits, build(params, vocab_size=5, prompts=[[0, 1, 2, 4]] * 2))
    assert torch.isfinite(out[:, [0, 1, 3, 4]]).all() and (out[:, 2] == float("-inf")).all()
    assert out[0, 0] < -1e38 and out[1, 1] > 1e38 and out[0, 3] == 0.5


def test_top_k_then_top_p_matches_reference() -> None:
    params = [SamplingParams(top_k=k, top_p=p)
              for k, p in [(3, 0.5), (10, 0.9), (40, 0.3), (0, 0.7), (8, 1.0)]]
    check_filters(params, seed=4)


def test_min_p_matches_reference() -> None:
    params = [SamplingParams(min_p=m, temperature=t)
              for m, t in [(0.05, 1.0), (0.2, 0.6), (0.5, 2.0), (1.0, 1.0), (0.0, 1.0)]]
    assert build(params).any_min_p
    check_filters(params, seed=5)


def test_all_filters_together_match_reference() -> None:
    params = [SamplingParams(temperature=0.9, top_k=30, top_p=0.8, min_p=0.1),
              SamplingParams(temperature=1.7, top_k=12, top_p=0.95, min_p=0.02),
              SamplingParams(temperature=0.4, min_p=0.3, top_p=0.6)]
    check_filters(params, seed=6)


def test_filters_leave_greedy_rows_alone() -> None:
    logits = random_logits(2, seed=7)
    params = [SamplingParams(temperature=0.0, top_k=2, top_p=0.1, min_p=0.9),
              SamplingParams(top_k=2)]
    filtered = filter_logits(logits, build(params))
    assert torch.equal(filtered[0], logits[0])
    assert torch.isfinite(filtered[1]).sum() == 2


# ---- sampling -----------------------------------------------------------------------------

def test_greedy_takes_argmax_of_penalised_logits() -> None:
    logits = random_logits(4, seed=8)
    outputs = [[int(logits[i].argmax())] for i in range(4)]
    params = [SamplingParams(temperature=0.0, repetition_penalty=r) for r in (1.0, 5.0)]
    params += [SamplingParams(temperature=1e-7), SamplingParams(temperature=0.0, top_k=3)]
    tensors = build(params, outputs=outputs)
    assert tensors.all_greedy
    got = Sampler()(logits, tensors).token_ids
    assert torch.equal(got, apply_penalties(logits, tensors).argmax(-1))
    assert got[0] == logits[0].argmax() and got[1] != logits[1].argmax()


def test_greedy_batch_draws_no_random_numbers_and_keeps_logits() -> None:
    logits = random_logits(3, seed=9)
    before = logits.clone()
    generator = torch.Generator().manual_seed(1)
    seeded_state = generator.get_state()
    state = torch.get_rng_state()
    Sampler()(logits, build([SamplingParams(temperature=0.0, seed=1,
                                            repetition_penalty=1.5)] * 3,
                            outputs=[[0, 1, 2]] * 3, banned=[[3]] * 3,
                            generators=[generator, None, None]))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(generator.get_state(), seeded_state)
    assert torch.equal(logits, before)


def test_banned_tokens_are_never_sampled() -> None:
    banned_ids = [0, 5, 9]
    logits = random_logits(4, seed=10)
    logits[:, banned_ids] = 30.0  # by far the likeliest tokens, were they allowed
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=2.0),
              SamplingParams(temperature=1.0, top_k=4, seed=3), SamplingParams(min_p=0.5)]
    generators = [None, None, torch.Generator().manual_seed(3), None]
    tensors = build(params, banned=[banned_ids + [V + 100]] * 4, generators=generators)
    sampler = Sampler()
    for _ in range(200):
        ids = sampler(logits, tensors).token_ids.tolist()
        assert not set(ids) & set(banned_ids)


def test_logit_bias_shifts_the_named_logits_first() -> None:
    logits = random_logits(3, seed=11)
    params = [SamplingParams(logit_bias={3: 5.0, 7: -2.5}), SamplingParams(),
              SamplingParams(logit_bias={0: 1.0}, repetition_penalty=2.0)]
    prompts = [[], [], [0, 1]]
    got = apply_penalties(logits, build(params, prompts=prompts))
    expected = logits.clone()
    expected[0, 3] += 5.0
    expected[0, 7] -= 2.5
    expected[2, 0] += 1.0  # biased, then penalised as the biased logit
    expected[2] = reference_penalties(expected[2], params[2], [0, 1], [])
    torch.testing.assert_close(got, expected)
    # Greedy follows the bias; logprobs stay the raw model's (vLLM's default).
    row = logits[1:2]
    worst = int(row.argmin())
    biased = [SamplingParams(temperature=0.0, logit_bias={worst: 100.0}, logprobs=0)]
    out = Sampler()(row, build(biased))
    assert out.token_ids.tolist() == [worst]
    assert out.logprobs[0, 0].item() == pytest.approx(row.log_softmax(-1)[0, worst].item())


def test_allowed_token_ids_restrict_their_rows_only() -> None:
    logits = random_logits(3, seed=12)
    allowed = [4, 9, 60]
    params = [SamplingParams(temperature=0.0, allowed_token_ids=allowed),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.5, allowed_token_ids=allowed, seed=1)]
    generators = [None, None, torch.Generator().manual_seed(1)]
    tensors = build(params, generators=generators)
    masked = apply_penalties(logits, tensors)
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == allowed
    torch.testing.assert_close(masked[1], logits[1])
    sampler = Sampler()
    seen = set()
    for _ in range(200):
        ids = sampler(logits, tensors).token_ids.tolist()
        assert ids[0] == max(allowed, key=lambda t: logits[0, t])
        assert ids[1] == int(logits[1].argmax())
        seen.add(ids[2])
    assert seen <= set(allowed) and len(seen) > 1
    for bad in ([], [-1], [1.0], "5", [True]):
        with pytest.raises(ValueError, match="^allowed_token_ids must"):
            SamplingParams(allowed_token_ids=bad)


def test_bad_logit_bias_is_refused() -> None:
    for bad in ({-1: 1.0}, {"5": 1.0}, {5: 101.0}, {5: True}, [5]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


def test_temperature_sampling_follows_softmax() -> None:
    logits = torch.tensor([1.0, 0.5, -0.3, 2.0, 0.0, -1.0, 1.2, 0.8])
    temperature, draws = 0.7, 20_000
    tensors = build([SamplingParams(temperature=temperature)] * draws, vocab_size=8)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        ids = Sampler()(logits.expand(draws, -1), tensors).token_ids
    # 7 degrees of freedom: P(chi2 > 24.32) = 0.001 for a correct sampler.
    assert chi_square(ids, (logits / temperature).softmax(-1)) < 24.32


def test_seeded_filtered_sampling_follows_filtered_softmax() -> None:
    logits = torch.tensor([1.0, 0.5, -0.3, 2.0, 0.0, -1.0, 1.2, 0.8])
    params = SamplingParams(temperature=1.3, top_k=5, seed=0)
    draws = 4_000
    generators = [torch.Generator().manual_seed(i) for i in range(draws)]
    ids = Sampler()(logits.expand(draws, -1),
                    build([params] * draws, vocab_size=8, generators=generators)).token_ids
    keep = reference_kept(logits, params)
    expected = (logits / params.temperature).masked_fill(~keep, float("-inf")).softmax(-1)
    # 4 degrees of freedom (5 tokens kept): P(chi2 > 18.47) = 0.001.
    assert chi_square(ids, expected) < 18.47


def _sample_seeded_request(steps: list[torch.Tensor], params: SamplingParams,
                           companions: list[list[tuple[SamplingParams, int]]],
                           positions: list[int]) -> list[int]:
    """Run one seeded request for len(steps) steps inside batches of other rows."""
    generator = torch.Generator().manual_seed(params.seed)
    sampler = Sampler()
    tokens = []
    for step, (row_logits, others, position) in enumerate(zip(steps, companions, positions)):
        batch = [(p, torch.Generator().manual_seed(p.seed) if p.seed is not None else None)
                 for p, _ in others]
        batch.insert(position, (params, generator))
        logits = random_logits(len(batch), seed=1000 + step)
        logits[position] = row_logits
        out = sampler(logits, build([p for p, _ in batch], generators=[g for _, g in batch],
                                    outputs=[tokens if p is params else [] for p, _ in batch]))
        tokens.append(out.token_ids[position].item())
    return tokens


def test_seeded_request_is_independent_of_its_batch() -> None:
    steps = [random_logits(1, seed=200 + s)[0] / 3.0 for s in range(8)]
    params = SamplingParams(temperature=1.5, top_p=0.95, presence_penalty=0.5, seed=1234)
    alone = _sample_seeded_request(steps, params, [[]] * 8, [0] * 8)
    assert len(set(alone)) > 1  # the test would prove nothing if the draws were forced

    others = [SamplingParams(temperature=0.0), SamplingParams(top_k=5),
              SamplingParams(temperature=0.8, seed=99), SamplingParams(min_p=0.2, seed=5),
              SamplingParams(top_p=0.5, repetition_penalty=1.2)]
    for trial in range(3):
        gen = torch.Generator().manual_seed(trial)
        companions, positions = [], []
        for _ in steps:
            size = int(torch.randint(1, 6, (1,), generator=gen))
            picks = torch.randint(0, len(others), (size,), generator=gen).tolist()
            companions.append([(others[k], k) for k in picks])
            positions.append(int(torch.randint(0, size + 1, (1,), generator=gen)))
        torch.manual_seed(trial)  # the unseeded rows' draws differ from trial to trial too
        assert _sample_seeded_request(steps, params, companions, positions) == alone


def test_seeded_generator_advances_by_one_draw_per_step() -> None:
    generator = torch.Generator().manual_seed(42)
    twin = torch.Generator().manual_seed(42)
    sampler = Sampler()
    params = [SamplingParams(seed=42, top_k=3), SamplingParams()]
    for step in range(3):
        sampler(random_logits(2, seed=step),
                build(params, generators=[generator, None]))
        torch.empty(V).exponential_(generator=twin)
        assert torch.equal(generator.get_state(), twin.get_state())


def test_mixed_batch_in_one_call() -> None:
    logits = random_logits(5, seed=11)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=77)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3),
              SamplingParams(top_k=1, temperature=1.5),
              SamplingParams(top_k=3),
              seeded,
              SamplingParams(min_p=0.3, temperature=0.5)]
    outputs = [[int(logits[0].argmax())], [], [], [], []]
    tensors = build(params, outputs=outputs,
                    generators=[None, None, None, torch.Generator().manual_seed(77), None])
    assert not tensors.all_greedy and not tensors.all_random
    ids = Sampler()(logits, tensors).token_ids.tolist()

    assert ids[0] == int(apply_penalties(logits, tensors)[0].argmax())
    assert ids[1] == int(logits[1].argmax())
    for i in (2, 3, 4):
        assert reference_kept(logits[i], params[i])[ids[i]]
    alone = Sampler()(logits[3:4], build([seeded],
                                         generators=[torch.Generator().manual_seed(77)]))
    assert ids[3] == alone.token_ids.item()


# ---- logprobs -----------------------------------------------------------------------------

def test_logprobs_are_raw_log_softmax() -> None:
    logits = random_logits(4, seed=12)
    params = [SamplingParams(logprobs=None), SamplingParams(logprobs=0),
              SamplingParams(logprobs=5, repetition_penalty=2.0, temperature=0.3),
              SamplingParams(logprobs=3, temperature=0.0, presence_penalty=1.0)]
    out = Sampler()(logits, build(params, prompts=[[1, 2]] * 4, outputs=[[3, 4]] * 4))
    assert out.logprobs.shape == (4, 6) and out.logprob_token_ids.shape == (4, 6)
    assert out.logprobs.dtype == torch.float32 and out.logprob_token_ids.dtype == torch.int64
    raw = logits.log_softmax(-1)
    assert torch.equal(out.logprob_token_ids[:, 0], out.token_ids)
    assert torch.equal(out.logprob_token_ids[:, 1:], raw.topk(5, dim=-1).indices)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.logprob_token_ids))


def test_logprobs_zero_and_none() -> None:
    logits = random_logits(2, seed=13)
    only_sampled = Sampler()(logits, build([SamplingParams(logprobs=0), SamplingParams()]))
    assert only_sampled.logprobs.shape == (2, 1)
    none = Sampler()(logits, build([SamplingParams(), SamplingParams(temperature=0.0)]))
    assert none.logprobs is None and none.logprob_token_ids is None


def test_half_precision_logits_are_sampled_in_float32() -> None:
    logits = random_logits(2, seed=14).to(torch.bfloat16)
    out = Sampler()(logits, build([SamplingParams(temperature=0.0, logprobs=2)] * 2))
    assert out.logprobs.dtype == torch.float32
    assert torch.equal(out.token_ids, logits.float().argmax(-1))
