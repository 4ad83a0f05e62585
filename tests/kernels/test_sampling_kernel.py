"""The fused greedy / temperature sampling kernel against torch, on the CPU interpreter."""
import os
from types import SimpleNamespace

# Must precede any triton import: the kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nanoserve.kernels.sampling import (  # noqa: E402
    INTERPRETER_TILE,
    TILES_PER_CHUNK,
    SamplingConfig,
    candidates,
    sample_tokens,
)
from nanoserve.runner.sampler import _fused_path_applies, _fused_sample  # noqa: E402
from nanoserve.runner.sampling_tensors import SamplingTensors  # noqa: E402
from nanoserve.sampling_params import SamplingParams  # noqa: E402
from sampling_stats import chi_square  # noqa: E402

TILE = INTERPRETER_TILE  # logits per tile on CPU (32)
CHUNK = TILES_PER_CHUNK * TILE  # logits per program on CPU (64)
NEG_INF = float("-inf")


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return sample_tokens(logits, torch.zeros(logits.shape[0]), seed=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab_size", [5, TILE + 3, CHUNK, 3 * CHUNK + 1, 1000])
def test_greedy_is_torch_argmax(dtype, vocab_size):
    """Sizes below one tile, inside one chunk, and several chunks plus a one-logit chunk."""
    gen = torch.Generator().manual_seed(vocab_size)
    # Rows of a wider buffer: the row stride is not the vocabulary size.
    logits = (3 * torch.randn(7, vocab_size + 8, generator=gen)).to(dtype)[:, 3:3 + vocab_size]
    last = vocab_size - 1
    logits[1, ::2] = NEG_INF  # -inf around the finite logits, wherever the max was
    logits[2] = NEG_INF
    logits[2, last] = -1e4
    logits[3] = NEG_INF  # nothing finite: token 0, as torch.argmax
    # Planted ties with the row max: neighbours in one tile, the same slot of the next
    # tile, the next chunk; the lowest index must win.
    for row, (a, b) in zip((4, 5, 6), ((0, 1), (1, min(1 + TILE, last)), (last // 2, last))):
        logits[row, [a, b]] = logits[row].max() + 1
    got = greedy(logits)
    assert got.dtype == torch.int64 and got.shape == (7,)
    assert torch.equal(got, logits.argmax(dim=-1))
    assert got[2] == last and got[3] == 0


def test_temperature_sampling_follows_softmax():
    """Empirical frequencies of 800 draws match softmax(logits / T), and not at 2T."""
    logits = torch.tensor([1.0, 0.5, -0.3, 2.0, NEG_INF, -1.0, 1.2, 0.8,
                           0.1, NEG_INF, 1.5, -0.5, 0.3, 0.9, NEG_INF, NEG_INF])
    temperature, draws = 1.0, 800
    ids = sample_tokens(logits.expand(draws, -1), torch.full((draws,), temperature),
                        seed=1234)
    # 11 degrees of freedom (12 finite logits): P(chi2 > 31.26) = 0.001 for a correct sampler.
    assert chi_square(ids, (logits / temperature).softmax(-1)) < 31.26  # also: -inf never drawn
    assert chi_square(ids, (logits / (2 * temperature)).softmax(-1)) > 31.26


def test_draws_across_tiles_follow_softmax():
    """Probability spread over tiles whose maxima differ: each tile's sum is rescaled to the
    row's maximum before the tile is chosen. Logits near 40 would overflow an unshifted exp."""
    gen = torch.Generator().manual_seed(21)
    vocab_size, temperature, draws = 7 * TILE - 5, 0.7, 1000
    logits = torch.full((vocab_size,), NEG_INF)
    finite = torch.tensor([0, TILE - 1, TILE, 70, 3 * TILE - 1, 3 * TILE, 130, 150,
                           vocab_size - 1])
    logits[finite] = 40 + torch.randn(len(finite), generator=gen)
    logits[[5, 6 * TILE]] = -20.0  # finite, but ~e^-86 of the mass: never drawn
    ids = sample_tokens(logits.expand(draws, -1), torch.full((draws,), temperature), seed=5)
    # 8 degrees of freedom (9 tokens that carry the mass): P(chi2 > 26.12) = 0.001.
    assert chi_square(ids, (logits / temperature).softmax(-1)) < 26.12
    assert chi_square(ids, (logits / (2 * temperature)).softmax(-1)) > 26.12
    assert set(ids.tolist()) <= set(finite.tolist())


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the huge row
def test_special_values_in_sampled_rows():
    """NaN is never drawn, an infinite or overflowing logit wins, and a tiny temperature
    draws the argmax."""
    gen = torch.Generator().manual_seed(4)
    vocab_size, draws = 3 * TILE + 7, 40
    base = torch.randn(vocab_size, generator=gen)
    nan_row = torch.full((vocab_size,), float("nan"))
    nan_row[[2, TILE + 3, 2 * TILE + 9]] = base[[2, TILE + 3, 2 * TILE + 9]]
    inf_row = base.clone()
    inf_row[TILE + 1] = float("inf")
    huge_row = base.clone()
    huge_row[[3, 2 * TILE]] = 3e38  # times log2(e) / T overflows float32
    rows = torch.stack([nan_row, inf_row, huge_row, base]).repeat(draws, 1)
    temperature = torch.tensor([1.0, 1.0, 0.5, 1e-5]).repeat(draws)
    ids = sample_tokens(rows, temperature, seed=17).view(draws, 4)
    assert set(ids[:, 0].tolist()) == {2, TILE + 3, 2 * TILE + 9}
    assert (ids[:, 1] == TILE + 1).all()
    assert set(ids[:, 2].tolist()) == {3, 2 * TILE}
    assert (ids[:, 3] == base.argmax()).all()


def test_checked_ids_mark_rows_with_unusable_logits():
    """With ``checked_out``, rows holding a NaN or +inf logit, or no finite one, get the void id
    (as mark_failed_rows marks them), greedy or sampled, in any chunk; the others their token."""
    from nanoserve.runner.sampler import mark_failed_rows

    gen = torch.Generator().manual_seed(8)
    vocab_size = 3 * CHUNK + 5
    logits = torch.randn(12, vocab_size, generator=gen)
    logits[0, 3] = float("nan")
    logits[1, vocab_size - 1] = float("nan")  # in the last, one-tile chunk
    logits[2, CHUNK + 1] = float("inf")
    logits[3] = NEG_INF
    logits[4, ::3] = NEG_INF  # -inf alone is fine
    logits[5, 7] = 3e38  # huge but finite
    logits = torch.cat([logits[:6], logits[:6]])
    temperature = torch.tensor([0.0] * 6 + [1.0] * 6)
    checked = torch.empty(12, dtype=torch.int64)
    ids = sample_tokens(logits, temperature, seed=5, checked_out=checked, void_id=-2)
    assert torch.equal(checked, mark_failed_rows(logits, ids))
    assert checked.tolist().count(-2) == 8
    assert torch.equal(ids, sample_tokens(logits, temperature, seed=5))


def test_same_seed_same_tokens_other_seed_other_tokens():
    """On a flat distribution over three chunks: each draw is a fresh uniform token."""
    rows, vocab_size = 32, 2 * CHUNK + 1
    flat = torch.zeros(rows, vocab_size)
    temperature = torch.ones(rows)
    first = sample_tokens(flat, temperature, seed=7)
    assert torch.equal(sample_tokens(flat, temperature, seed=7), first)
    # A seed above 2^31 uses the high half of the key.
    other = sample_tokens(flat, temperature, seed=2 ** 40 + 7)
    assert (other == first).sum() <= 2  # each row agrees with probability 1 / 129
    both = torch.cat([first, other])
    assert len(set(both.tolist())) > 40  # rows draw independent uniforms
    # Every tile of every full chunk gets draws.
    assert set((both // TILE).tolist()) >= set(range(2 * CHUNK // TILE))


def test_mixed_batch():
    """Rows with temperature 0 are argmax; the others are sampled, unaffected by them."""
    gen = torch.Generator().manual_seed(3)
    logits = 0.1 * torch.randn(6, 3 * TILE, generator=gen)
    logits[1, 1::2] = NEG_INF
    logits[4] = NEG_INF
    logits[5] = NEG_INF  # no finite logit: token 0, greedy or not
    greedy_rows = torch.tensor([True, False, True, False, False, True])
    temperature = torch.where(greedy_rows, 0.0, 1.0)
    ids = sample_tokens(logits, temperature, seed=11)
    assert torch.equal(ids[greedy_rows], logits[greedy_rows].argmax(-1))
    assert ids[1] % 2 == 0 and ids[4] == 0 and ids[5] == 0
    assert ids[3] != logits[3].argmax()  # flat logits: 1 / 96 to draw the argmax
    # A sampled row's draw depends on the seed and its own row only.
    all_sampled = sample_tokens(logits, torch.ones(6), seed=11)
    assert torch.equal(all_sampled[~greedy_rows], ids[~greedy_rows])


def test_seed_read_from_a_tensor_and_negative_draws_nothing():
    """A decode CUDA graph passes the seed as a tensor it refills each step: the same draws
    as the int, and -1 (a batch for the general sampler) leaves the output untouched."""
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(5, 300, generator=gen)
    temperature = torch.tensor([0.0, 0.7, 1.0, 0.0, 1.3])
    by_int = sample_tokens(logits, temperature, seed=2 ** 33 + 5)
    by_tensor = sample_tokens(logits, temperature, torch.tensor([2 ** 33 + 5]))
    assert torch.equal(by_int, by_tensor)
    assert not torch.equal(by_tensor, sample_tokens(logits, temperature, torch.tensor([6])))
    out = torch.full((5,), -7)
    assert sample_tokens(logits, temperature, torch.tensor([-1]), out=out) is out
    assert out.tolist() == [-7] * 5
    sample_tokens(logits, temperature, torch.tensor([2 ** 33 + 5]), out=out)
    assert torch.equal(out, by_int)


def test_empty_batch():
    assert sample_tokens(torch.empty(0, 10), torch.empty(0), seed=1).shape == (0,)


def sampling_tensors(params: list[SamplingParams], vocab_size: int, banned=None,
                     generators=None) -> SamplingTensors:
    n = len(params)
    return SamplingTensors.build(params, [[1, 2]] * n, [[3]] * n, banned or [[]] * n,
                                 generators or [None] * n, vocab_size, torch.device("cpu"))


def test_sampler_fuses_only_temperature_batches():
    """The Sampler's choice, with a stand-in for CUDA logits (the fused path is CUDA-only)."""
    cuda_logits = SimpleNamespace(is_cuda=True, stride=lambda dim: 1)
    plain = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, logprobs=2)]
    assert _fused_path_applies(cuda_logits, sampling_tensors(plain, 16))
    assert not _fused_path_applies(torch.zeros(2, 16), sampling_tensors(plain, 16))
    for extra in (dict(repetition_penalty=1.1), dict(presence_penalty=0.5),
                  dict(frequency_penalty=0.5), dict(top_k=5), dict(top_p=0.9),
                  dict(min_p=0.1)):
        tensors = sampling_tensors(plain + [SamplingParams(**extra)], 16)
        assert not _fused_path_applies(cuda_logits, tensors), extra
    banned = sampling_tensors(plain, 16, banned=[[4], []])
    assert not _fused_path_applies(cuda_logits, banned)
    seeded = sampling_tensors(plain + [SamplingParams(seed=3)], 16,
                              generators=[None, None, torch.Generator().manual_seed(3)])
    assert not _fused_path_applies(cuda_logits, seeded)
    # The noise seed the fused pass (and a decode graph) reads: -1 where the batch needs the
    # general sampler, 0 for an all-greedy batch, which draws nothing from the generator.
    assert seeded.noise_seed.tolist() == banned.noise_seed.tolist() == [-1]
    state = torch.get_rng_state()
    assert sampling_tensors(plain[:1] * 3, 16).noise_seed.tolist() == [0]
    assert torch.equal(torch.get_rng_state(), state)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        drawn = sampling_tensors(plain, 16).noise_seed.item()
        torch.manual_seed(1)
        assert drawn == sampling_tensors(plain, 16).noise_seed.item() > 0


def test_fused_sampler_path_with_logprobs():
    """The Sampler's fused path end to end: greedy rows, raw logprobs, no RNG for greedy."""
    logits = 3 * torch.randn(3, 40, generator=torch.Generator().manual_seed(5))
    greedy_only = sampling_tensors([SamplingParams(temperature=0.0, logprobs=3)] * 3, 40)
    state = torch.get_rng_state()
    out = _fused_sample(logits, greedy_only)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    raw = logits.log_softmax(-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], raw.topk(3, dim=-1).indices)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.logprob_token_ids))
    mixed = sampling_tensors([SamplingParams(temperature=0.0), SamplingParams()] * 2, 40)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        first = _fused_sample(logits[[0, 0, 1, 1]], mixed)
        torch.manual_seed(0)
        again = _fused_sample(logits[[0, 0, 1, 1]], mixed)
    assert first.logprobs is None and torch.equal(first.token_ids, again.token_ids)
    assert first.token_ids[0] == logits[0].argmax() and first.token_ids[2] == logits[1].argmax()


def test_tokens_do_not_depend_on_how_the_batch_is_chunked():
    """Larger batches take wider chunks per program (tiles_per_chunk); a tile's results and
    the uniform (keyed by row) do not depend on it, so a row's draw is the same in a batch of 1,
    32 or 256."""
    from nanoserve.kernels.sampling import tiles_per_chunk

    assert tiles_per_chunk(1) == TILES_PER_CHUNK < tiles_per_chunk(32) < tiles_per_chunk(256)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(256, 1000, generator=gen)
    temperature = torch.full((256,), 0.7)
    whole = sample_tokens(logits, temperature, seed=99)
    for rows in (1, 32):
        assert torch.equal(sample_tokens(logits[:rows], temperature[:rows], seed=99),
                           whole[:rows])
    assert len(set(whole.tolist())) > 50  # draws, not one argmax repeated


@pytest.mark.parametrize("config", [SamplingConfig(16, 3, 8), candidates(1)[1]],
                         ids=["small-tiles", "candidate"])
def test_other_launches_draw_the_same_tokens(config):
    """A tuner times other tiles and chunks: greedy rows still take the argmax, and sampled
    rows the same tokens (the draw is by cumulative mass, whatever the tiles; only a rounding
    at a token's boundary could differ). 16-logit tiles, 3 a program: the last chunk partial."""
    gen = torch.Generator().manual_seed(8)
    logits = 2 * torch.randn(16, 7 * 16 * 3 - 5, generator=gen)
    temperature = torch.where(torch.arange(16) % 4 == 0, 0.0, 0.8)
    drawn = sample_tokens(logits, temperature, seed=11, config=config)
    assert torch.equal(drawn, sample_tokens(logits, temperature, seed=11))
    assert torch.equal(drawn[::4], logits[::4].argmax(-1))


def test_start_up_compile_runs_every_chunk_width_once(monkeypatch):
    """ModelRunner compiles the kernel variants before serving: one batch per chunk width."""
    import nanoserve.kernels.sampling as sampling

    calls = []
    monkeypatch.setattr(sampling, "sample_tokens",
                        lambda logits, temperature, seed, bitmask=None:
                        calls.append((sampling.tiles_per_chunk(logits.shape[0]),
                                      bitmask is not None)))
    sampling.compile_for_batches(256, 50, torch.float32, torch.device("cpu"))
    widths = {sampling.tiles_per_chunk(b) for b in range(1, 257)}
    assert len(widths) == 4
    # Each chunk width once without a grammar's bitmask and once with one.
    assert sorted(calls) == sorted((w, masked) for w in widths for masked in (False, True))


@pytest.mark.parametrize("vocab_size", [TILE - 5, 3 * CHUNK + 7])
def test_bitmask_inside_the_kernel_equals_sampling_masked_logits(vocab_size):
    """Rows held to a grammar's bitmask draw the same tokens as the kernel on logits with the
    forbidden tokens at -inf (same seed), only allowed tokens, and the others are untouched."""
    from nanoserve.runner.sampler import apply_bitmask

    gen = torch.Generator().manual_seed(vocab_size)
    batch, words = 6, (vocab_size + 31) // 32
    logits = 2 * torch.randn(batch, vocab_size, generator=gen)
    temperature = torch.tensor([0.0, 0.7, 1.0, 0.0, 1.3, 0.9])
    rows = torch.tensor([4, 0, 2, 5])  # in any order; rows 1 and 3 have no grammar
    allowed = torch.rand(len(rows), vocab_size, generator=gen) < 0.1
    allowed[1] = False
    allowed[1, vocab_size - 1] = True  # one token allowed, the vocabulary's last
    allowed[3] = False
    allowed[3, [2, vocab_size // 2]] = True
    padded = torch.zeros(len(rows), words * 32, dtype=torch.bool)
    padded[:, :vocab_size] = allowed
    bits = (padded.view(len(rows), words, 32).long() << torch.arange(32)).sum(-1)
    bits = bits.to(torch.int64).where(bits < 2 ** 31, bits - 2 ** 32).to(torch.int32)
    for seed in range(4):
        got = sample_tokens(logits, temperature, seed=seed, bitmask=(rows, bits))
        masked = apply_bitmask(logits, (rows, bits))
        assert torch.equal(got, sample_tokens(masked, temperature, seed=seed))
        assert allowed[torch.arange(len(rows)), got[rows]].all()
        assert got[0] == vocab_size - 1
        free = sample_tokens(logits, temperature, seed=seed)
        assert got[1] == free[1] and got[3] == logits[3].argmax()
        mask_rows = torch.full((batch,), -1, dtype=torch.int32)
        mask_rows[rows] = torch.arange(len(rows), dtype=torch.int32)
        assert torch.equal(got, sample_tokens(logits, temperature, seed=seed,
                                              bitmask=(None, bits), mask_rows=mask_rows))
