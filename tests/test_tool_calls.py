"""Tool calls: the Hermes-format parser, its streaming form, and the server end to end.

The end-to-end tests serve a model built to answer with a tool call: every token of the answer
has its own embedding direction, the layers add nothing (their output projections are zero),
and the LM head maps each token's direction to the next token of the answer. So the real
engine, Qwen3's real tokenizer and chat template, and the server produce that answer through
the official openai client.
"""
from __future__ import annotations

import json
import signal
from pathlib import Path

import openai
import pytest
import torch
from test_server import API_KEY, MODEL, start_server

from nanoserve.entrypoints.tool_calls import ToolCallStream, parse_tool_calls

QWEN3_TOKENIZER = Path(__file__).resolve().parents[1] / ".cache" / "qwen3-tokenizer"
CALL = '<tool_call>{"name":"get_weather","arguments":{"city": "Paris"}}</tool_call>'
ANSWER = "Checking." + CALL
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


# ---- the server ------------------------------------------------------------------------------

def build_answering_model(out: Path) -> Path:
    """A one-layer Llama with Qwen3's tokenizer whose greedy answer to any chat prompt (which
    ends in a newline) is ANSWER, then <|im_end|>."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(QWEN3_TOKENIZER)
    # The chat prompt's last token, the answer's tokens, then the end of the turn.
    chain = [tok.encode(text, add_special_tokens=False) for text in ("\n", ANSWER)]
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


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    if not (QWEN3_TOKENIZER / "tokenizer.json").exists():
        pytest.skip("Qwen3's tokenizer is fetched by `make test` "
                    "(bash benchmarks/fetch_qwen3_tokenizer.sh, needs npm)")
    tmp = tmp_path_factory.mktemp("tools")
    server = start_server(build_answering_model(tmp / "model"), tmp / "log",
                          "--api-key", API_KEY)
    yield openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    server.proc.send_signal(signal.SIGINT)
    try:
        assert server.proc.wait(30) == 0, server.log_tail()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


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


def test_unsupported_tool_choice_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, tools=[WEATHER_TOOL], tool_choice="required")
    assert info.value.body["param"] == "tool_choice"
