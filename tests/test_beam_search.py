"""Beam search against transformers' (num_beams, early_stopping=True) on the same fp32 weights."""
from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from reference import PROMPTS
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanoserve import LLM, BeamSearchParams, SamplingParams
from nanoserve.beam_search import beam_search

NEW_TOKENS = 6


def hf_beams(model, ids: list[int], width: int, eos: int | None, length_penalty: float
             ) -> tuple[list[list[int]], list[float] | None]:
    """transformers' ``width`` returned beams (generated tokens, cut after the EOS) and their
    scores (None for one beam, which transformers runs as greedy search)."""
    out = model.generate(torch.tensor([ids]), num_beams=width, num_return_sequences=width,
                         do_sample=False, max_new_tokens=NEW_TOKENS, early_stopping=True,
                         length_penalty=length_penalty, eos_token_id=eos,
                         pad_token_id=eos if eos is not None else 0,
                         return_dict_in_generate=True, output_scores=True)
    beams = []
    for seq in out.sequences.tolist():
        tokens = seq[len(ids):]
        if eos is not None and eos in tokens:
            tokens = tokens[:tokens.index(eos) + 1]
        beams.append(tokens)
    return beams, out.sequences_scores.tolist() if width > 1 else None


@pytest.fixture(scope="module")
def prompt_ids(tiny_qwen3):
    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    return [tok.encode(p) for p in PROMPTS[:4]]


@pytest.mark.parametrize("width,length_penalty", [(1, 1.0), (3, 1.0), (4, 0.5)])
def test_beams_match_transformers_without_eos(tiny_qwen3, prompt_ids, width, length_penalty):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    llm = LLM(str(tiny_qwen3), device="cpu", dtype="float32")
    outs = llm.beam_search(prompt_ids, BeamSearchParams(width, NEW_TOKENS, ignore_eos=True,
                                                        length_penalty=length_penalty))
    for ids, out in zip(prompt_ids, outs):
        beams, scores = hf_beams(model, ids, width, None, length_penalty)
        assert out.prompt_token_ids == ids
        assert [h.token_ids for h in out.sequences] == beams
        if scores is not None:
            assert [h.score for h in out.sequences] == pytest.approx(scores, abs=1e-4)
    if width == 1:  # one beam is greedy decoding
        greedy = llm.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                          ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in greedy] == \
            [out.sequences[0].token_ids for out in outs]
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "blocks leaked"


def test_beams_match_transformers_when_eos_ends_some(tiny_qwen3, prompt_ids, tmp_path):
    """A model whose EOS is a token its beams pick early, so hypotheses end on the way."""
    llm = LLM(str(tiny_qwen3), device="cpu", dtype="float32")
    first = llm.beam_search(prompt_ids[:1], BeamSearchParams(3, NEW_TOKENS, ignore_eos=True))
    eos = first[0].sequences[0].token_ids[2]
    llm.close()
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_qwen3, model_dir)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((model_dir / name).read_text())
        config["eos_token_id"] = eos
        (model_dir / name).write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    llm = LLM(str(model_dir), device="cpu", dtype="float32")
    outs = llm.beam_search(prompt_ids, BeamSearchParams(3, NEW_TOKENS))
    ended = 0
    for ids, out in zip(prompt_ids, outs):
        beams, scores = hf_beams(model, ids, 3, eos, 1.0)
        assert [h.token_ids for h in out.sequences] == beams
        assert [h.score for h in out.sequences] == pytest.approx(scores, abs=1e-4)
        ended += sum(h.finished for h in out.sequences)
        assert all(h.finished == (h.token_ids[-1] == eos) for h in out.sequences)
    assert ended > 0, "no hypothesis ended with the EOS: the test would not test it"


def test_text_prompts_and_decoded_text(tiny_qwen3, prompt_ids):
    llm = LLM(str(tiny_qwen3), device="cpu", dtype="float32")
    params = BeamSearchParams(2, 4, ignore_eos=True)
    by_text = llm.beam_search(PROMPTS[0], params)
    by_ids = llm.beam_search([prompt_ids[0]], params)
    assert [h.token_ids for h in by_text[0].sequences] == \
        [h.token_ids for h in by_ids[0].sequences]
    for h in by_text[0].sequences:
        assert h.text == llm.tokenizer.decode(h.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("kwargs,match", [
    (dict(beam_width=0, max_tokens=4), "beam_width"),
    (dict(beam_width=11, max_tokens=4), "beam_width"),
    (dict(beam_width=True, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
])
def test_bad_params_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**kwargs)


class ScriptedLLM:
    """Just enough of ``LLM`` for ``beam_search``: each step's logprobs come from a table keyed
    by the beam's tokens, so the selection rules can be checked by hand (EOS is 9)."""

    def __init__(self, table: dict[tuple[int, ...], dict[int, float]]):
        self.table = table
        self.engine = SimpleNamespace(model_config=SimpleNamespace(eos_token_ids=[9]))
        self.tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: str(ids))

    def generate(self, prompts, params, use_tqdm):
        assert params.logprobs == 4 and params.max_tokens == 1
        return [SimpleNamespace(outputs=[SimpleNamespace(logprobs=[self.table[tuple(p[1:])]])])
                for p in prompts]


def test_an_eos_outside_the_first_beam_width_candidates_ends_nothing():
    table = {
        (): {1: -0.1, 2: -0.5, 9: -0.6, 3: -3.0},  # the EOS ranks third of four: dropped
        (1,): {9: -2.0, 4: -2.1, 5: -4.0, 6: -4.1},  # ranks second of the step's candidates
        (2,): {1: -1.5, 7: -3.0, 8: -3.1, 6: -3.2},
    }
    out = beam_search(ScriptedLLM(table), [[0]], BeamSearchParams(2, 2))[0]
    assert [(h.token_ids, h.finished) for h in out.sequences] == [([2, 1], False), ([1, 9], True)]
    assert [h.score for h in out.sequences] == pytest.approx([-1.0, -1.05])
    assert out.sequences[1].text == "[1, 9]"


def test_a_prompt_stops_once_beam_width_hypotheses_have_ended():
    table = {
        (): {1: -0.1, 2: -0.2, 3: -5.0, 4: -5.1},
        (1,): {9: -0.1, 5: -3.0, 6: -3.1, 7: -3.2},
        (2,): {9: -0.1, 5: -3.0, 6: -3.1, 7: -3.2},
    }  # no entry for longer beams: a third step would fail
    out = beam_search(ScriptedLLM(table), [[0]], BeamSearchParams(2, 5))[0]
    assert [h.token_ids for h in out.sequences] == [[1, 9], [2, 9]]
