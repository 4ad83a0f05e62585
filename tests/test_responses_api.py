"""POST /v1/responses through the official openai client over a real socket: text in and
out, instructions, message lists, streamed typed events, forced function calls and their
outputs, previous_response_id, bad input; and what `serve` shows a newcomer (its name for
the model, the ready line, CORS)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from test_server import start_server

ORIGIN = "http://allowed.example"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
               "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    # No --served-model-name: the model is served under the path given.
    srv = start_server(tiny_llama, tmp_path_factory.mktemp("responses") / "log",
                       "--log-level", "info", "--allowed-origins", ORIGIN,
                       served_model_name=None)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def model(tiny_llama) -> str:
    return str(tiny_llama)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _chat(client, model, messages, max_tokens):
    return client.chat.completions.create(model=model, messages=messages, temperature=0,
                                          max_tokens=max_tokens)


def test_serve_shows_its_name_for_the_model_a_ready_line_and_cors(server, client, model):
    assert [m.id for m in client.models.list().data] == [model]
    log = server.log.read_text()
    assert f"nanoserve: serving {model!r}: chat page {server.url}/, OpenAI API {server.url}/v1" in log
    assert "KV blocks of 16 tokens, max_model_len 512" in log
    preflight = {"Access-Control-Request-Method": "POST"}
    allowed = httpx.options(server.url + "/v1/responses", headers={"Origin": ORIGIN,
                                                                   **preflight})
    assert allowed.headers.get("access-control-allow-origin") == ORIGIN
    other = httpx.get(server.url + "/v1/models", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_text_in_and_out_equals_the_chat_answer(client, model):
    resp = client.responses.create(model=model, input="Name a colour.", temperature=0,
                                   instructions="Be brief.", max_output_tokens=8)
    chat = _chat(client, model, [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Name a colour."}], 8)
    assert resp.output_text == chat.choices[0].message.content and resp.output_text
    assert resp.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                           else "completed")
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.model == model and resp.instructions == "Be brief."
    assert client.responses.retrieve(resp.id).output_text == resp.output_text


def test_stream_sends_typed_events_adding_up_to_the_whole(client, model):
    kwargs = dict(model=model, input=[{"role": "user", "content": "Tell me a story."}],
                  temperature=0, max_output_tokens=12)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text  # token by token
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == whole.output_text


def test_previous_response_id_continues_the_conversation(client, model):
    first = client.responses.create(model=model, input="Hi!", temperature=0,
                                    max_output_tokens=6)
    second = client.responses.create(model=model, input="And then?", temperature=0,
                                     max_output_tokens=6, previous_response_id=first.id)
    chat = _chat(client, model, [{"role": "user", "content": "Hi!"},
                                 {"role": "assistant", "content": first.output_text},
                                 {"role": "user", "content": "And then?"}], 6)
    assert second.output_text == chat.choices[0].message.content
    assert second.previous_response_id == first.id


@pytest.mark.parametrize("stream", [False, True])
def test_forced_function_call_and_its_output(client, model, stream):
    kwargs = dict(model=model, input="What is the weather in Rome?", tools=[WEATHER],
                  tool_choice={"type": "function", "name": "get_weather"},
                  max_output_tokens=40, temperature=0)
    if stream:
        events = list(client.responses.create(stream=True, **kwargs))
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert len(done) == 1 and json.loads(done[0].arguments)["city"] in ("Paris", "Rome")
        resp = events[-1].response
    else:
        resp = client.responses.create(**kwargs)
    calls = [item for item in resp.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Rome")
    follow = client.responses.create(
        model=model, previous_response_id=resp.id, temperature=0, max_output_tokens=4,
        tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": '{"celsius": 21}'}])
    assert follow.output[0].type == "message" and follow.usage.input_tokens > \
        resp.usage.input_tokens


@pytest.mark.parametrize("body, field", [
    ({"input": "x", "temperature": -1.0}, "temperature"),
    ({"input": "x", "top_p": 2.0}, "top_p"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0]"),
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
])
def test_bad_input_is_a_400_naming_the_field(server, model, body, field):
    got = httpx.post(server.url + "/v1/responses", json={"model": model, **body}, timeout=60)
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["param"] is not None and error["param"].startswith(field), error
