"""Speculative decoding: greedy outputs exactly as without it, sampling exactly the target's
distribution, KV rolled back after rejections, and its configuration's errors."""
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY_COMMON
from sampling_stats import chi_square

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.engine.request import Request
from nanoserve.engine.spec_decode import SpecDecoder
from nanoserve.engine.spec_ngram import NgramProposer
from nanoserve.spec_config import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
PASSAGE = ("The quick brown fox jumps over the lazy dog. The dog did not move, and the fox ran "
           "into the forest, where it met an old owl who lived in a tall oak tree.")
PROMPTS_PLAIN = ["The capital of France is", "def fibonacci(n):"]
REPEAT_PROMPTS = [
    f"Repeat the passage exactly.\nPassage: {PASSAGE}\nRepeat: {PASSAGE}\nRepeat:",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Monday, Tuesday, Wednesday, Monday, Tuesday, Wednesday, Monday,",
]


@contextlib.contextmanager
def speculation(llm: LLM, config: dict | None):
    """The same engine (same weights, same cache) with other speculation: none (None) or
    n-gram lookup, set up as the engine's constructor does it."""
    engine = llm.engine
    saved = engine.spec, engine.scheduler.proposer
    engine.spec = None if config is None else SpecDecoder(
        SpeculativeConfig(**config), engine.max_model_len)
    engine.scheduler.proposer = None if config is None else engine.spec.propose
    try:
        yield
    finally:
        engine.spec, engine.scheduler.proposer = saved


def speculation_off(llm: LLM):
    return speculation(llm, None)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _assert_no_leak(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "blocks leaked"


# --- configuration -------------------------------------------------------------------------

@pytest.mark.parametrize("bad, field", [
    ({"method": "medusa"}, "method"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": "4"}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"method": "draft_model"}, "model"),
    ({"method": "ngram", "model": "x"}, "model"),
    ({"num_speculative_token": 4}, "unknown keys"),
    ("{not json", "JSON"),
    (3, "dict"),
])
def test_bad_speculative_config_names_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(speculative_config=bad)


def test_speculative_config_from_json_and_vllm_defaults():
    config = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 5,'
                                             ' "prompt_lookup_max": 3}')
    spec = config.speculative_config
    assert (spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 3, 3)
    assert EngineConfig(speculative_config={}).speculative_config.prompt_lookup_min == 5
    # The CLI hands LLM(...) the config as a dict again: it must come back the same.
    assert EngineConfig(**dataclasses.asdict(config)).speculative_config == spec


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_and_server_take_speculative_config_as_json(command):
    from nanoserve.entrypoints.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args([command, "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 2}'])
    spec = engine_config_from_args(args).speculative_config
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        engine_config_from_args(build_parser().parse_args(
            [command, "--speculative-config", '{"num_speculative_tokens": -1}']))


# --- n-gram proposals ----------------------------------------------------------------------

def _reference_proposal(seq: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The latest earlier occurrence of the longest suffix n-gram, by brute force."""
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        suffix = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start:start + n] == suffix:
                return seq[start + n:start + n + k]
    return []


def test_ngram_proposer_matches_brute_force_lookup():
    gen = np.random.default_rng(0)
    proposer = NgramProposer(2, 4)
    hits = 0
    for _ in range(300):
        seq = gen.integers(0, 4, size=int(gen.integers(1, 40))).tolist()  # few ids: many matches
        got = proposer.propose(np.asarray(seq, dtype=np.int64), 3)
        assert got == _reference_proposal(seq, 2, 4, 3), seq
        hits += bool(got)
    assert hits > 100


def test_a_growing_history_is_proposed_from_as_a_fresh_copy_would_be():
    """The kept int64 copy of a sequence's tokens takes only the new ones each step (one, a
    verify's several, a prompt's hundreds) and proposes as the whole history would."""
    config = EngineConfig(speculative_config=NGRAM).speculative_config
    spec = SpecDecoder(config, max_model_len=10_000)
    gen = np.random.default_rng(1)
    req = Request("r", None, gen.integers(0, 6, size=3).tolist(),
                  SamplingParams(temperature=0.0, max_tokens=5000), 5000, frozenset())
    proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    hits = 0
    for grow in [1, 1, 4, 300, 1, 2, 1000, 1, 3]:
        req.token_ids += gen.integers(0, 6, size=grow).tolist()
        got = spec.propose(req)
        assert np.array_equal(req.spec_state.known_tokens(req.token_ids), req.token_ids)
        assert got == proposer.propose(np.asarray(req.token_ids, dtype=np.int64),
                                       req.spec_state.k)
        hits += bool(got)
    assert hits >= 6


def test_rejected_proposals_shrink_then_pause_then_come_back():
    """A sequence whose proposals are always rejected proposes ever less often, so it runs
    almost only plain decodes; once they are accepted again, proposals grow back to k."""
    config = EngineConfig(speculative_config=NGRAM).speculative_config
    spec = SpecDecoder(config, max_model_len=1000)
    req = Request("r", None, [1, 2, 3, 4] * 8, SamplingParams(temperature=0.0,
                                                              max_tokens=500), 500, frozenset())
    proposed = []
    for _ in range(200):
        drafts = spec.propose(req)
        proposed.append(len(drafts))
        if drafts:
            spec.record(req, len(drafts), 0, len(req.token_ids))
    assert proposed[0] == 4 and proposed[1] == 2
    assert sum(map(bool, proposed)) < 12  # paused ever longer: few wasted verifies
    assert sum(map(bool, proposed[100:])) <= 2
    while not (drafts := spec.propose(req)):
        pass
    for _ in range(4):
        spec.record(req, len(drafts), len(drafts), len(req.token_ids))
        drafts = spec.propose(req)
    assert len(drafts) == 4
    assert spec.stats.num_accepted_tokens > 0 and spec.stats.accepted_per_pos[0] > 0
    # Requests whose sampling reads their history, or under a grammar, never propose.
    for params in (SamplingParams(repetition_penalty=1.2), SamplingParams(min_tokens=5),
                   SamplingParams(prompt_logprobs=1)):
        other = Request("o", None, [1, 2, 3, 4] * 8, params, 50, frozenset())
        assert spec.propose(other) == []


# --- greedy exactness ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_spec(smollm2_path):
    """SmolLM2 with itself as a draft model; tests switch it to n-gram lookup or to none.
    Dequantized to fp32: a verify's rows then round as one-token steps do (the kept-int4
    kernel computes in bf16, where a row's result may depend on the batch's shape)."""
    return LLM(str(smollm2_path), max_model_len=512, num_kv_blocks=48, block_size=16,
               quantization="none",
               speculative_config={"method": "draft_model", "model": str(smollm2_path),
                                   "num_speculative_tokens": 3})


def test_smollm2_drafting_for_itself_keeps_greedy_outputs(smollm2_spec):
    llm, params = smollm2_spec, _greedy(16)
    with speculation_off(llm):
        want = _ids(llm.generate(PROMPTS_PLAIN, params, use_tqdm=False))
    assert _ids(llm.generate(PROMPTS_PLAIN, params, use_tqdm=False)) == want
    spec = llm.engine.stats().spec
    assert spec.num_accepted_tokens > 0.9 * spec.num_draft_tokens > 0  # the same model
    draft = llm.engine.spec.draft.bm
    assert draft.num_free_blocks == draft.num_blocks
    _assert_no_leak(llm)


def test_smollm2_greedy_with_speculation_equals_without(smollm2_spec):
    llm, params = smollm2_spec, _greedy(24)
    with speculation(llm, NGRAM):
        got = _ids(llm.generate(REPEAT_PROMPTS[:2], params, use_tqdm=False))
        spec = llm.engine.stats().spec
    assert spec.num_draft_tokens > 0
    assert spec.num_accepted_tokens > spec.num_draft_tokens / 2  # the text repeats
    assert spec.accepted_per_pos[3] > 0
    _assert_no_leak(llm)
    with speculation_off(llm):
        assert _ids(llm.generate(REPEAT_PROMPTS[:2], params, use_tqdm=False)) == got
    # A prompt that goes on with the output hits the blocks that verify steps filled: only
    # accepted tokens were hashed, and their K/V is what a plain decode computes.
    prompt = llm.tokenizer.encode(REPEAT_PROMPTS[0]) + got[0][:16]
    hits = llm.engine.stats().prefix_cache_hits
    with speculation_off(llm):
        out = llm.generate([prompt], _greedy(8), use_tqdm=False)[0]
    assert out.num_cached_tokens > len(prompt) - 16
    assert llm.engine.stats().prefix_cache_hits > hits
    assert out.outputs[0].token_ids == got[0][16:]
    _assert_no_leak(llm)


def test_smollm2_stop_strings_and_logprobs_under_speculation(smollm2_spec):
    llm = smollm2_spec
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=1, stop=["lazy"])
    with speculation_off(llm):
        want = llm.generate(REPEAT_PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    drafts = llm.engine.stats().spec.num_draft_tokens
    got = llm.generate(REPEAT_PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    assert llm.engine.stats().spec.num_draft_tokens > drafts  # the draft model's
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")
    assert len(got.logprobs) == len(got.token_ids)
    for g, w in zip(got.logprobs, want.logprobs):
        assert g.keys() == w.keys()
        assert np.allclose(list(g.values()), list(w.values()), atol=1e-4)
    # max_tokens is never passed, even when every proposal would be accepted.
    for n in (1, 2, 5):
        out = llm.generate(REPEAT_PROMPTS[:1], _greedy(n), use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == n and out.finish_reason == "length"
    _assert_no_leak(llm)


@pytest.fixture(scope="module")
def repeating_ids(tiny_llama):
    """Token-id prompts that repeat themselves, so that proposals come."""
    gen = np.random.default_rng(1)
    out = []
    for n in (6, 9, 13):
        unit = gen.integers(100, 5000, size=n).tolist()
        out.append(unit * 3 + unit[:2])
    return out + [[7] * 30]


PREEMPTION = {"num_kv_blocks": 14, "block_size": 8}
CHUNKED = {"max_num_batched_tokens": 9, "block_size": 8}


@pytest.fixture(scope="module")
def noisy_llama(tiny_llama, tmp_path_factory) -> Path:
    """tiny_llama with slightly perturbed weights: a draft that agrees with it often."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.005)
    out = tmp_path_factory.mktemp("noisy-llama")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(out)
    return out


@pytest.mark.parametrize("proposer, engine_args", [
    ("ngram", {}), ("ngram", PREEMPTION), ("ngram", CHUNKED),
    ("itself", CHUNKED), ("noisy", PREEMPTION), ("other", {}),
], ids=["ngram", "ngram-preemption", "ngram-chunked", "draft-itself-chunked",
        "draft-noisy-preemption", "draft-other"])
def test_tiny_greedy_with_speculation_equals_without(tiny_llama, tiny_qwen3, noisy_llama,
                                                     repeating_ids, proposer, engine_args):
    """n-gram lookup; drafts by the model itself (all accepted), by a perturbed copy (partly
    accepted: the draft's cache rolls back mid-proposal) and by another random model (nearly
    all rejected)."""
    drafts = {"itself": tiny_llama, "noisy": noisy_llama, "other": tiny_qwen3}
    config = NGRAM if proposer == "ngram" else {
        "method": "draft_model", "num_speculative_tokens": 3, "model": str(drafts[proposer])}
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", speculative_config=config,
              **engine_args)
    with speculation_off(llm):
        want = _ids(llm.generate(repeating_ids, _greedy(24), use_tqdm=False))
    stats0 = llm.engine.stats()
    llm.reset_prefix_cache()
    assert _ids(llm.generate(repeating_ids, _greedy(24), use_tqdm=False)) == want
    stats = llm.engine.stats()
    assert stats.spec.num_draft_tokens > 0
    if proposer != "other":
        assert stats.spec.num_accepted_tokens > 0
    if proposer == "noisy":  # accepted in part: some verifies stop after one proposal
        assert 0 < stats.spec.accepted_per_pos[1] < stats.spec.num_drafts
    if "num_kv_blocks" in engine_args:
        assert stats.num_preemptions > stats0.num_preemptions
    if "max_num_batched_tokens" in engine_args:
        assert stats.num_partial_prefills > stats0.num_partial_prefills
    _assert_no_leak(llm)
    if llm.engine.spec.draft is not None:
        draft = llm.engine.spec.draft.bm
        assert draft.num_free_blocks == draft.num_blocks, "draft blocks leaked"


def test_no_blocks_leak_after_rejections_and_aborts(tiny_llama, repeating_ids):
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", block_size=4,
              speculative_config=NGRAM)
    engine = llm.engine
    for i, ids in enumerate(repeating_ids):
        engine.add_request(str(i), ids, _greedy(30))
    engine.step()  # the prompts, with proposals from them verified in the same forward
    assert engine.stats().spec.num_drafts == len(repeating_ids)
    for req in engine.scheduler.running:  # the K/V of every token but the newest stands
        assert req.num_computed_tokens == len(req.token_ids) - 1 >= len(req.prompt_token_ids)
    for _ in range(3):
        engine.step()
    spec = engine.stats().spec
    assert spec.num_draft_tokens > spec.num_accepted_tokens  # some were rejected
    engine.abort_request(["0", "2"])
    while engine.has_unfinished_requests():
        engine.step()
    _assert_no_leak(llm)
    # The counters as the server's /metrics shows them, under vLLM's names.
    from nanoserve.engine.metrics import ServerMetrics

    spec = engine.stats().spec
    text = ServerMetrics("m", engine.stats).render()[0].decode()
    for name, value in (("num_draft_tokens", spec.num_draft_tokens),
                        ("num_accepted_tokens", spec.num_accepted_tokens)):
        assert f'nanoserve:spec_decode_{name}_total{{model_name="m"}} {float(value)}' in text
    assert (f'nanoserve:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",'
            f'position="0"}} {float(spec.accepted_per_pos[0])}') in text


# --- sampling follows the target's distribution ---------------------------------------------

@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory, tokenizer_dir) -> Path:
    """A tiny random Llama with a 512-token vocabulary: cheap exact distributions."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**TINY_COMMON, vocab_size=512, head_dim=16, eos_token_id=0,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)
    out = tmp_path_factory.mktemp("vocab512")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


def _chi_square_tail(df: int) -> float:
    """The chi-square distribution's 0.1% tail bound (Wilson-Hilferty: within 1% here)."""
    return df * (1 - 2 / (9 * df) + 3.090 * (2 / (9 * df)) ** 0.5) ** 3


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 3, 1.0, 0.0), (0.8, 4, 0.9, 0.1)])
def test_sampling_with_speculation_follows_the_target_distribution(
        small_vocab_model, temperature, top_k, top_p, min_p):
    """The joint law of three tokens sampled with two n-gram proposals verified per step,
    against transformers' exact one (the sampler's filters in float64), by a chi-square test
    over the outcomes of nonzero probability."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(small_vocab_model, dtype=torch.float32)

    def probs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double() / temperature
        logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], float("-inf"))
        p = logits.softmax(-1)
        ranked, order = p.sort(descending=True)
        cut = (ranked.cumsum(0) - ranked >= top_p) & (top_p < 1.0)
        p[order[cut]] = 0.0
        p[p < min_p * p.max()] = 0.0
        return p / p.sum()

    gen = torch.Generator().manual_seed(1)
    head, middle = (torch.randint(3, 512, (n,), generator=gen).tolist() for n in (10, 6))
    # The prompt ends with token 300, seen once before: its followers are the proposals,
    # chosen as the model's likeliest next tokens, so that many are accepted.
    d1 = d2 = 7
    for _ in range(3):
        prompt = head + [300, d1, d2] + middle + [300]
        d1 = int(probs(prompt).argmax())
        d2 = int(probs(prompt + [d1]).argmax())
    prompt = head + [300, d1, d2] + middle + [300]
    p1 = probs(prompt)
    cell_of, expected = {}, []  # the outcomes of nonzero probability
    for a in p1.nonzero()[:, 0].tolist():
        p2 = probs(prompt + [a])
        for b in p2.nonzero()[:, 0].tolist():
            p3 = probs(prompt + [a, b])
            for c in p3.nonzero()[:, 0].tolist():
                cell_of[a, b, c] = len(expected)
                expected.append(p1[a] * p2[b] * p3[c])
    expected.append(0.0)  # any other outcome

    llm = LLM(str(small_vocab_model), device="cpu", dtype="float32", speculative_config={
        "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
        "prompt_lookup_max": 2, "disable_when_slower": False})  # every step speculates
    n = 3000
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                             max_tokens=3, seed=s, ignore_eos=True) for s in range(n)]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    cells = torch.tensor([cell_of.get(tuple(t), len(expected) - 1) for t in _ids(outs)])
    spec = llm.engine.stats().spec
    assert spec.accepted_per_pos[0] > n / 10 and spec.accepted_per_pos[1] > n / 20
    # Seeded, so the test is deterministic.
    stat = chi_square(cells, torch.tensor(expected))
    assert stat < _chi_square_tail(len(expected) - 2)
    # Seeded requests are reproducible whatever else is batched.
    again = llm.generate([prompt] * 5, params[10:15], use_tqdm=False)
    assert _ids(again) == _ids(outs[10:15])
    _assert_no_leak(llm)


def test_draft_model_beside_a_tensor_parallel_target(tiny_llama, noisy_llama, repeating_ids):
    """The draft runs whole in rank 0's process; greedy output equals one rank's without it."""
    one = LLM(str(tiny_llama), device="cpu", dtype="float32")
    want = _ids(one.generate(repeating_ids, _greedy(24), use_tqdm=False))
    one.close()
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", tensor_parallel_size=2,
              speculative_config={"method": "draft_model", "num_speculative_tokens": 3,
                                  "model": str(noisy_llama)})
    try:
        assert _ids(llm.generate(repeating_ids, _greedy(24), use_tqdm=False)) == want
        stats = llm.engine.stats()
        assert stats.spec.num_accepted_tokens > 0
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        llm.close()
