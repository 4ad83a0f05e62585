"""When generation stops, what text comes out, and the offline API's shape around it."""
from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from nanoserve import LLM, SamplingParams
from nanoserve.engine.detokenizer import IncrementalDetokenizer

PROMPT = "Once upon a time, in a land far away, there lived a"
N = 40  # tokens of the reference continuation


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32")
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def smol(smollm2_path):
    llm = LLM(str(smollm2_path), device="cpu", dtype="float32")
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def base(tiny):
    """The greedy continuation of PROMPT with no stop condition: token ids and text."""
    out = _one(tiny, SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.token_ids) == N
    assert len(out.text) > 60
    return out


def _one(llm, params, prompt=PROMPT):
    [out] = llm.generate([prompt], params, use_tqdm=False)
    assert out.finished
    return out.outputs[0]


def _greedy(**kw):
    return SamplingParams(**{"temperature": 0.0, "max_tokens": N, "ignore_eos": True, **kw})


def _boundaries(tok, ids, text):
    """Character offsets in ``text`` where a token's text starts (whole characters only)."""
    prefixes = [tok.decode(ids[:k], skip_special_tokens=True) for k in range(len(ids))]
    return [len(p) for p in prefixes if text.startswith(p) and "\ufffd" not in p]


def _spanning_stop(tok, base, after: int, length: int = 4) -> str:
    """A stop string from the text that straddles a token boundary, at or past char ``after``."""
    for b in _boundaries(tok, base.token_ids, base.text):
        if b >= after + 2:
            stop = base.text[b - 2:b - 2 + length]
            if len(stop) == length and stop.strip() and "\ufffd" not in stop:
                return stop
    raise AssertionError("no token boundary to put a stop string across")


# ---- stop strings -----------------------------------------------------------------------------

@pytest.mark.parametrize("after", [10, 60])
def test_stop_string_cuts_text_right_before_it(tiny, base, after):
    stop = _spanning_stop(tiny.tokenizer, base, after)
    idx = base.text.find(stop)
    out = _one(tiny, _greedy(stop=stop))
    assert out.text == base.text[:idx]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    # generation ended with the token that completed the stop string
    assert out.token_ids == base.token_ids[:len(out.token_ids)]
    done = tiny.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    before = tiny.tokenizer.decode(out.token_ids[:-1], skip_special_tokens=True)
    assert stop in done and stop not in before


def test_stop_string_included_when_asked(tiny, base):
    stop = _spanning_stop(tiny.tokenizer, base, 30)
    idx = base.text.find(stop)
    out = _one(tiny, _greedy(stop=[stop], include_stop_str_in_output=True))
    assert out.text == base.text[:idx + len(stop)]
    assert out.text.endswith(stop)
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_earliest_of_several_stop_strings_wins(tiny, base):
    late = _spanning_stop(tiny.tokenizer, base, 70)
    early = _spanning_stop(tiny.tokenizer, base, 20)
    assert base.text.find(early) + len(early) <= base.text.find(late)
    out = _one(tiny, _greedy(stop=[late, early, "\x00never\x00"]))
    assert out.text == base.text[:base.text.find(early)]
    assert out.stop_reason == early


def test_stop_string_that_never_occurs_changes_nothing(tiny, base):
    out = _one(tiny, _greedy(stop=["\x00never\x00"]))
    assert out.text == base.text and out.token_ids == base.token_ids
    assert out.finish_reason == "length" and out.stop_reason is None


def test_stop_strings_before_min_tokens_are_ignored(tiny, base):
    tok = tiny.tokenizer
    first = tok.decode(base.token_ids[:2], skip_special_tokens=True)
    stop = first.strip()[:3]
    assert stop and stop in first
    out = _one(tiny, _greedy(stop=stop, min_tokens=6))
    assert len(out.token_ids) >= 6
    assert out.token_ids == base.token_ids[:len(out.token_ids)]
    # the occurrences inside the first six tokens' text stay; a later one may stop it
    six = tok.decode(base.token_ids[:6], skip_special_tokens=True)
    assert out.text.startswith(six)


# ---- stop tokens, EOS, min_tokens, ignore_eos -------------------------------------------------

@pytest.mark.parametrize("include", [False, True])
def test_stop_token_ids(tiny, base, include):
    tok = tiny.tokenizer
    stop_tok = base.token_ids[5]
    j = base.token_ids.index(stop_tok)
    out = _one(tiny, _greedy(stop_token_ids=[stop_tok], include_stop_str_in_output=include))
    assert out.token_ids == base.token_ids[:j + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    kept = base.token_ids[:j + 1] if include else base.token_ids[:j]
    assert out.text == tok.decode(kept, skip_special_tokens=True)


def test_min_tokens_suppresses_stop_tokens_until_reached(tiny, base):
    stop_tok = base.token_ids[1]
    j = base.token_ids.index(stop_tok)
    min_tokens = j + 5
    out = _one(tiny, _greedy(stop_token_ids=[stop_tok], min_tokens=min_tokens))
    assert len(out.token_ids) >= min_tokens
    assert stop_tok not in out.token_ids[:min_tokens]
    assert out.token_ids[:j] == base.token_ids[:j]  # same until the banned position
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == stop_tok and stop_tok not in out.token_ids[:-1]
    else:
        assert len(out.token_ids) == N and stop_tok not in out.token_ids


CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def test_eos_min_tokens_and_ignore_eos(smol):
    eos = smol.engine.model_config.eos_token_ids
    [plain] = smol.chat(CAPITAL, SamplingParams(temperature=0.0, max_tokens=14), use_tqdm=False)
    plain = plain.outputs[0]
    assert plain.finish_reason == "stop" and plain.stop_reason is None
    assert plain.token_ids[-1] in eos and len(plain.token_ids) < 12
    assert "Paris" in plain.text and "<|im_end|>" not in plain.text
    n = len(plain.token_ids)

    [late] = smol.chat(CAPITAL, SamplingParams(temperature=0.0, max_tokens=14, min_tokens=n + 2),
                       use_tqdm=False)
    late = late.outputs[0]
    assert len(late.token_ids) >= n + 2
    assert not set(late.token_ids[:n + 2]) & set(eos)
    assert late.token_ids[:n - 1] == plain.token_ids[:-1]

    [full] = smol.chat(CAPITAL, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
                       use_tqdm=False)
    full = full.outputs[0]
    assert full.finish_reason == "length" and full.stop_reason is None
    assert len(full.token_ids) == 14
    assert full.token_ids[:n] == plain.token_ids  # went straight past the EOS


def test_chat_applies_the_template(smol):
    questions = ["What is the capital of France?", "What is the capital of Germany?"]
    outs = smol.chat([[{"role": "user", "content": q}] for q in questions],
                     SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    assert "Paris" in outs[0].outputs[0].text
    assert "Berlin" in outs[1].outputs[0].text
    for q, out in zip(questions, outs):
        prompt = smol.tokenizer.decode(out.prompt_token_ids)
        assert prompt.startswith("<|im_start|>") and f"user\n{q}<|im_end|>" in prompt
        assert prompt.endswith("<|im_start|>assistant\n")


# ---- detokenization and streaming -------------------------------------------------------------

MULTILINGUAL = ("Hello wörld! 你好，世界。🙂🚀👨‍👩‍👧 naïve café — ½ ∑ 日本語のテキスト. "
                "Ünïcödé ✓ 한국어 текст عربى 🎉🎉 ok?\n\n  spaced  end")


def test_incremental_detokenizer_matches_full_decode(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    text_ids = tok.encode(MULTILINGUAL)
    assert len(text_ids) < len(MULTILINGUAL.encode())  # multi-byte chars are split over tokens
    specials = tok.all_special_ids
    rng = random.Random(0)
    prompts = [tok.encode("Say something:"), tok.encode("<|im_start|>assistant\n"), [specials[0]]]
    for trial in range(400):
        kind = trial % 4
        if kind == 0:  # any vocabulary ids, special tokens included
            seq = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 25))]
        elif kind == 3:  # text tokens with special tokens sprinkled in
            seq = [rng.choice(text_ids + specials) for _ in range(rng.randint(1, 25))]
        else:  # a slice of multi-byte text, cutting characters at either end
            a = rng.randrange(len(text_ids))
            seq = text_ids[a:rng.randint(a + 1, len(text_ids))]
        for skip in (True, False):
            detok = IncrementalDetokenizer(tok, rng.choice(prompts), skip)
            deltas = [detok.push(t) for t in seq]
            text = "".join(deltas) + detok.flush()
            assert text == tok.decode(seq, skip_special_tokens=skip), (seq, skip)
            # no delta splits a character (no replacement char unless the decode has one)
            if "\ufffd" not in tok.decode(seq, skip_special_tokens=skip):
                assert all("\ufffd" not in d for d in deltas)


def test_a_character_split_over_tokens_waits_for_its_end(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tok.encode("🚀")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok, tok.encode("Go "), True)
    assert [detok.push(t) for t in ids] == [""] * (len(ids) - 1) + ["🚀"]
    detok = IncrementalDetokenizer(tok, tok.encode("Go "), True)
    assert detok.push(ids[0]) == ""
    assert detok.flush() == tok.decode(ids[:1]) == "\ufffd"  # cut short: as decode renders it


def test_final_text_equals_decode_wherever_generation_is_cut(tiny, base):
    tok = tiny.tokenizer
    cuts = [tok.decode(base.token_ids[:k], skip_special_tokens=True) for k in range(1, N + 1)]
    inside = {k for k in range(1, N + 1) if cuts[k - 1].endswith("\ufffd")}
    assert inside, "want a cut inside a character"
    ks = sorted(inside | set(range(1, N + 1, 3)))
    want = [cuts[k - 1] for k in ks]
    params = [_greedy(max_tokens=k) for k in ks]
    outs = tiny.generate([PROMPT] * len(ks), params, use_tqdm=False)  # decoded once, at the end
    assert [o.outputs[0].text for o in outs] == want
    _, finals = _stream(tiny.engine, [(str(k), PROMPT, p) for k, p in zip(ks, params)])
    assert [finals[str(k)].text for k in ks] == want  # decoded token by token


def test_final_text_equals_decode_of_sampled_tokens(tiny):
    prompts = [PROMPT, "你好，世界。", "🙂🚀", "def f(x):"]
    params = [SamplingParams(temperature=1.5, max_tokens=m, seed=i, ignore_eos=i % 2 == 0)
              for i, m in enumerate([7, 13, 20, 31])]
    for out in tiny.generate(prompts, params, use_tqdm=False):
        c = out.outputs[0]
        assert c.text == tiny.tokenizer.decode(c.token_ids, skip_special_tokens=True)


def _stream(engine, requests):
    """Run requests to completion with engine.step(); every text each one showed, in order."""
    texts: dict[str, list[str]] = {rid: [] for rid, _, _ in requests}
    finals = {}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id].append(out.outputs[0].text)
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    return texts, finals


def test_streamed_texts_grow_and_never_show_part_of_a_stop(tiny, base):
    stops = [_spanning_stop(tiny.tokenizer, base, after, length)
             for after, length in ((15, 3), (40, 5), (70, 6))]
    requests = [(f"s{i}", PROMPT, _greedy(stop=s)) for i, s in enumerate(stops)]
    requests += [("multi", PROMPT, _greedy(stop=stops[::-1])),
                 ("none", PROMPT, _greedy(stop=["\x00never\x00"])),
                 ("plain", PROMPT, _greedy()),
                 ("other", "The meaning of life is", _greedy(stop=[" the", "."]))]
    texts, finals = _stream(tiny.engine, requests)
    for rid, _, params in requests:
        seen = texts[rid]
        final = finals[rid].text
        assert seen[-1] == final
        for a, b in zip(seen, seen[1:]):
            assert b.startswith(a), (rid, a, b)
        for s in params.stop_strings:
            assert all(s not in t for t in seen)
    for i, s in enumerate(stops):
        assert finals[f"s{i}"].text == base.text[:base.text.find(s)]
    assert finals["multi"].text == finals["s0"].text
    assert finals["none"].text == finals["plain"].text == base.text
    assert len(texts["plain"]) == N  # one output per step without a stop: nothing held back


# ---- sampling and the offline API -------------------------------------------------------------

def test_seeded_sampling_is_independent_of_the_batch(tiny):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    alone = _one(tiny, seeded).token_ids
    assert _one(tiny, seeded).token_ids == alone
    others = ["Hello", "The capital of France is a city that", "1, 2, 3,"]
    params = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, seed=99, max_tokens=5),
              SamplingParams(temperature=0.0, max_tokens=11)]
    batch = tiny.generate([others[0], PROMPT, others[1], others[2]],
                          [params[0], seeded, params[1], params[2]], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, seed=4321, max_tokens=24, ignore_eos=True)
    assert _one(tiny, other_seed).token_ids != alone  # the seed is what fixes the tokens


def test_generate_keeps_input_order_with_mixed_lengths(tiny):
    prompts = ["A long prompt about " + "many things, " * 12, "Hi", "1, 2, 3,",
               "Translate to French: good morning"]
    lengths = [3, 25, 1, 12]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in lengths]
    outs = tiny.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [o.prompt_token_ids for o in outs] == [tiny.tokenizer.encode(p) for p in prompts]
    assert [len(o.outputs[0].token_ids) for o in outs] == lengths
    for prompt, p, out in zip(prompts, params, outs):  # each as if it ran alone
        assert _one(tiny, p, prompt).token_ids == out.outputs[0].token_ids
    # token-id prompts come back in order too, and a single prompt is a batch of one
    ids = [tiny.tokenizer.encode(p) for p in prompts]
    again = tiny.generate(ids, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    assert [o.prompt for o in again] == [None] * 4
    [single] = tiny.generate(ids[1], params[1], use_tqdm=False)
    assert single.outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_per_prompt_sampling_params(tiny, base):
    stop = _spanning_stop(tiny.tokenizer, base, 20)
    params = [_greedy(stop=stop), SamplingParams(temperature=0.0, max_tokens=2),
              SamplingParams(temperature=1.0, seed=7, max_tokens=9, ignore_eos=True),
              _greedy(stop_token_ids=[base.token_ids[3]])]
    outs = tiny.generate([PROMPT] * 4, params, use_tqdm=False)
    c = [o.outputs[0] for o in outs]
    assert c[0].text == base.text[:base.text.find(stop)] and c[0].stop_reason == stop
    assert c[1].token_ids == base.token_ids[:2] and c[1].finish_reason == "length"
    assert len(c[2].token_ids) == 9
    assert c[2].token_ids == _one(tiny, params[2]).token_ids
    assert c[3].stop_reason == base.token_ids[3]
    assert c[3].token_ids == base.token_ids[:base.token_ids.index(base.token_ids[3]) + 1]
    with pytest.raises(ValueError, match="2 SamplingParams for 4 prompts"):
        tiny.generate([PROMPT] * 4, params[:2], use_tqdm=False)
