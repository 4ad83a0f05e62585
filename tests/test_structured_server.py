"""Structured output through the official openai client over a real socket, on SmolLM2:
``response_format``, vLLM's extra fields, forced ``tool_choice``, and 400s for bad constraints."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from test_server import MODEL, start_server

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 12}},
                   "required": ["tz"]}}}
ASK = [{"role": "user", "content": "Tell me about a person called Ada, as JSON."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def client(smollm2_path, tmp_path_factory):
    server = start_server(smollm2_path, tmp_path_factory.mktemp("structured") / "log")
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    server.stop()


def _json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                   "strict": True}}


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema(client, stream):
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=64, temperature=0,
                  response_format=_json_schema_format(PERSON))
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(stream=True, **kwargs) if c.choices)
    else:
        text = client.chat.completions.create(**kwargs).choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)


def test_parse_with_a_pydantic_model(client):
    answer = client.beta.chat.completions.parse(model=MODEL, messages=ASK, max_tokens=64,
                                                temperature=0, response_format=Person)
    assert isinstance(answer.choices[0].message.parsed, Person)


def test_json_object_and_vllm_fields(client):
    ask = [{"role": "user", "content": 'Reply with a JSON object whose key "ok" is true.'}]
    reply = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=64,
                                           temperature=0,
                                           response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    for extra, check in [({"guided_choice": ["sunny", "rainy"]}, lambda t: t in ("sunny",
                                                                                "rainy")),
                         ({"guided_regex": "[0-9]{2}:[0-9]{2}"},
                          lambda t: len(t) == 5 and t[2] == ":"),
                         ({"structured_outputs": {"json": PERSON}},
                          lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
                         ({"guided_json": PERSON},
                          lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
                         ({"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}},
                          lambda t: t == json.dumps(json.loads(t), ensure_ascii=False))]:
        text = client.completions.create(model=MODEL, prompt="The weather today:",
                                         max_tokens=48, temperature=0,
                                         extra_body=extra).choices[0].text
        assert check(text), (extra, text)


def _calls(client, tool_choice, stream: bool) -> tuple[list[tuple[str, dict]], str]:
    kwargs = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME],
                  tool_choice=tool_choice, max_tokens=96, temperature=0)
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return ([(c.function.name, json.loads(c.function.arguments))
                 for c in choice.message.tool_calls], choice.finish_reason)
    calls, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            calls.append((call.function.name, json.loads(call.function.arguments)))
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
            assert not chunk.choices[0].delta.content
    return calls, finish


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named(client, stream):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    calls, finish = _calls(client, "required", stream)
    assert calls and finish == "tool_calls"
    for name, arguments in calls:
        jsonschema.validate(arguments, schemas[name])
    named = {"type": "function", "function": {"name": "get_time"}}
    calls, finish = _calls(client, named, stream)
    assert [name for name, _ in calls] == ["get_time"] and finish == "tool_calls"
    jsonschema.validate(calls[0][1], schemas["get_time"])


@pytest.mark.parametrize("extra, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": "nope"}}},
     "response_format"),
    ({"response_format": _json_schema_format({"type": "frobnicate"})}, "response_format"),
    ({"response_format": _json_schema_format({"type": "array", "uniqueItems": True})},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
    ({"guided_grammar": "root ::= nothing_here"}, "guided_grammar"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_constraints_are_400s_naming_the_field(client, extra, field):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                       extra_body=extra)
    assert err.value.body["param"] == field, err.value.body
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3)
    assert reply.choices[0].message.content is not None
