"""Structured output: answers held to JSON schemas, regexes, choices and grammars (xgrammar).

Against the real SmolLM2 sampled at temperature 1, every answer parses and validates; on a tiny
random model, greedy constrained decoding equals transformers' logits masked by xgrammar step
by step, and unconstrained requests beside constrained ones keep their own tokens.
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from json_schemas import SCHEMAS

from nanoserve import LLM, SamplingParams, StructuredOutputsParams
from nanoserve.engine.structured_output import check_enforceable

SEEDS = (0, 1)
ARITHMETIC = r'''
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor (("*" | "/") factor){0,2}
factor ::= [0-9] | [1-9] [0-9] | "(" expr ")"
'''
ARITHMETIC_RE = re.compile(r"[0-9()+\-*/]+")


@pytest.fixture(scope="module")
def smollm2():
    llm = LLM(None, max_num_seqs=64)
    yield llm
    llm.close()


def _params(seed: int, **constraint) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=128,
                          structured_outputs=StructuredOutputsParams(**constraint))


def test_sampled_json_always_validates(smollm2):
    conversations = [[{"role": "user", "content": "Answer with JSON that follows this schema: "
                       + json.dumps(schema)}] for schema in SCHEMAS for _ in SEEDS]
    params = [_params(seed, json=schema) for schema in SCHEMAS for seed in SEEDS]
    outs = smollm2.chat(conversations, params, use_tqdm=False)
    for i, out in enumerate(outs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (i, completion.text)
        jsonschema.validate(json.loads(completion.text), SCHEMAS[i // len(SEEDS)])


def test_compact_json_validates_without_free_whitespace(smollm2):
    schemas = SCHEMAS[:4]
    params = [_params(seed, json=schema, disable_any_whitespace=True)
              for schema in schemas for seed in (0, 1)]
    outs = smollm2.generate(["A JSON record:"] * len(params), params, use_tqdm=False)
    for i, out in enumerate(outs):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", (i, text)
        value = json.loads(text)
        jsonschema.validate(value, schemas[i // 2])
        assert text == json.dumps(value, ensure_ascii=False), text  # ", " and ": " only


def test_regex_choice_and_grammar_hold(smollm2):
    constraints = [dict(regex=r"[0-9]{3}-[a-z]{2,4}"), dict(choice=["yes", "no", 'it "depends"']),
                   dict(grammar=ARITHMETIC)]
    params = [_params(seed, **c) for c in constraints for seed in (0, 1, 2)]
    # An unbounded object is sampled greedily: at temperature 1 it may outlast any budget.
    params += [SamplingParams(temperature=0, max_tokens=64, structured_outputs=(
        StructuredOutputsParams(json_object=True)))] * 3
    prompts = ["Code:", "Is water wet?", "Write an arithmetic expression:",
               'Reply with a JSON object whose key "ok" is true:']
    outs = smollm2.generate([p for p in prompts for _ in range(3)], params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), texts
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t) for t in texts[:3]), texts
    assert all(t in ("yes", "no", 'it "depends"') for t in texts[3:6]), texts
    for text in texts[6:9]:
        assert ARITHMETIC_RE.fullmatch(text), text
        assert text.count("(") == text.count(")")
        compile(text, "<expr>", "eval")  # well formed
    assert all(isinstance(json.loads(t), dict) for t in texts[9:]), texts


# ---- equality on a tiny random model ---------------------------------------------------------

def _masked_greedy(model_dir, prompt_ids: list[int], constraint: StructuredOutputsParams,
                   max_tokens: int) -> list[int]:
    """transformers' greedy decoding with xgrammar's bitmask on each step's logits."""
    import numpy as np
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    vocab = model.config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab,
                                              stop_token_ids=[model.config.eos_token_id])
    compiler = xgr.GrammarCompiler(info)
    if constraint.regex is not None:
        grammar = compiler.compile_regex(constraint.regex)
    else:
        grammar = compiler.compile_json_schema(
            json.dumps(constraint.json), any_whitespace=not constraint.disable_any_whitespace,
            max_whitespace_cnt=None if constraint.disable_any_whitespace else 16)
    matcher = xgr.GrammarMatcher(grammar)
    bits = np.zeros((1, -(-vocab // 32)), dtype=np.int32)
    ids, out = list(prompt_ids), []
    with torch.no_grad():
        while len(out) < max_tokens and not matcher.is_terminated():
            logits = model(torch.tensor([ids])).logits[0, -1]
            matcher.fill_next_token_bitmask(bits)
            allowed = torch.from_numpy(np.unpackbits(bits.view(np.uint8), bitorder="little")
                                       [:vocab].astype(bool))
            token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            assert matcher.accept_token(token)
            ids.append(token)
            out.append(token)
    return out


CONSTRAINTS = [StructuredOutputsParams(regex=r"(ab|cd)+[0-9]{2,5}!"),
               StructuredOutputsParams(json=SCHEMAS[0]),
               StructuredOutputsParams(json=SCHEMAS[0], disable_any_whitespace=True)]


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama):
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32")
    yield llm
    llm.close()


@pytest.mark.parametrize("overlapped", [True, False])
def test_greedy_constrained_equals_masked_transformers(tiny_engine, tiny_llama, overlapped):
    prompts = [[5, 17, 300, 41], [1000, 2, 77], [64, 3, 900]]
    params = [SamplingParams(temperature=0, max_tokens=24, structured_outputs=c)
              for c in CONSTRAINTS]
    # A penalised request reads token histories, so the engine does not overlap steps.
    extra = [] if overlapped else [SamplingParams(temperature=0, max_tokens=24,
                                                  repetition_penalty=1.3)]
    outs = tiny_engine.generate(prompts + [[9, 9, 9]] * len(extra), params + extra,
                                use_tqdm=False)
    for prompt, constraint, out in zip(prompts, CONSTRAINTS, outs):
        assert out.outputs[0].token_ids == _masked_greedy(tiny_llama, prompt, constraint, 24)


def test_unconstrained_rows_keep_their_tokens(tiny_engine):
    free = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)]
    prompts = [[11, 12, 13], [400, 401]]
    alone = [o.outputs[0].token_ids for o in tiny_engine.generate(prompts, free, use_tqdm=False)]
    constrained = [SamplingParams(temperature=1.0, seed=s, max_tokens=20, structured_outputs=c)
                   for s, c in enumerate(CONSTRAINTS * 3)]
    mixed = tiny_engine.generate([[7, 8]] * len(constrained) + prompts, constrained + free,
                                 use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[len(constrained):]] == alone


def test_many_constrained_rows_equal_each_alone(tiny_engine):
    """A batch with enough grammar rows that xgrammar's batch call fills their bitmask (on
    the worker thread, beside the previous step's outputs) gives each the tokens it gets
    alone."""
    from nanoserve.engine.structured_output import FEW_ROWS

    params = [SamplingParams(temperature=0, max_tokens=16, structured_outputs=c)
              for c in CONSTRAINTS * (FEW_ROWS // 2 + 1)]
    prompts = [[5 + i, 17, 300] for i in range(len(params))]
    together = tiny_engine.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, together):
        alone = tiny_engine.generate([prompt], [p], use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids


# ---- validation --------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [{}, {"json": {}, "regex": "a"}, {"choice": []},
                                    {"choice": ["a", 1]}, {"regex": ""}, {"json": 3},
                                    {"json_object": "yes"},
                                    {"json": {}, "disable_any_whitespace": "yes"}])
def test_params_need_exactly_one_wellformed_constraint(kwargs):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**kwargs)


def test_unenforceable_keywords_are_refused_with_their_place():
    check_enforceable({"type": "object", "properties": {"not": {"type": "string"}}})
    with pytest.raises(ValueError, match=r"'uniqueItems' at #/properties/tags"):
        check_enforceable({"type": "object", "properties": {
            "tags": {"type": "array", "uniqueItems": True}}})
    with pytest.raises(ValueError, match=r"'not' at #/anyOf/1"):
        check_enforceable({"anyOf": [{"type": "string"}, {"not": {"type": "null"}}]})


@pytest.mark.parametrize("constraint, message", [
    (dict(json='{"type": "object", '), "cannot be compiled"),
    (dict(json={"type": "frobnicate"}), "Unsupported type"),
    (dict(json={"type": "array", "contains": {"type": "string"}}), "'contains'"),
    (dict(regex="a(b"), "parenthesis"),
    (dict(grammar="root ::= undefined_rule"), "not defined")])
def test_bad_constraints_raise_and_the_engine_goes_on(tiny_engine, constraint, message):
    with pytest.raises(ValueError, match=message):
        tiny_engine.generate([[1, 2]], SamplingParams(
            max_tokens=2, structured_outputs=StructuredOutputsParams(**constraint)),
            use_tqdm=False)
    assert len(tiny_engine.generate([[1, 2]], SamplingParams(max_tokens=3, ignore_eos=True),
                                    use_tqdm=False)[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("engine_args", [dict(num_kv_blocks=10, block_size=8),
                                         dict(tensor_parallel_size=2)],
                         ids=["preempting", "tp2"])
def test_constrained_tokens_survive_preemption_and_tensor_parallelism(tiny_engine, tiny_llama,
                                                                      engine_args):
    prompts = [[5, 17, 300, 41], [1000, 2, 77], [8, 9], [60, 61, 62], [70, 3], [4, 44, 444]]
    params = [SamplingParams(temperature=0, max_tokens=24, structured_outputs=c)
              for c in CONSTRAINTS * 2]
    expected = [o.outputs[0].token_ids for o in tiny_engine.generate(prompts, params,
                                                                     use_tqdm=False)]
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", **engine_args)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if "num_kv_blocks" in engine_args:
            assert llm.engine.stats().num_preemptions > 0
    finally:
        llm.close()
    assert got == expected
