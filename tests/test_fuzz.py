"""Schema-driven fuzzing of the OpenAI routes: schemathesis turns the app's own /openapi.json
into requests (bodies that fit the schema, and bodies that break it) sent over one keep-alive
connection to a real `nanoserve serve` of the tiny random Llama.

Over a real socket, not the ASGI app in-process: a dropped keep-alive connection after an
error, uvicorn's framing and the engine thread are part of what must hold. The server's own
limits (a short max_model_len, small max_n / max_logprobs) keep every generated request cheap,
so nothing is skipped or filtered: each answer must be a 2xx, or a 4xx in OpenAI's error shape.
"""
from __future__ import annotations

import json

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
import requests  # noqa: E402  (schemathesis' transport)
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from reference import hf_greedy, hf_model_and_prompts  # noqa: E402
from test_server import start_server  # noqa: E402

MODEL = "fuzzed"
# Per route: bodies that fit the schema, and (fewer: most fail validation alike) ones that don't.
EXAMPLES = {GenerationMode.POSITIVE: 300, GenerationMode.NEGATIVE: 100}
ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings",
          "/tokenize", "/detokenize"]
LIMITS = ("--max-model-len", "48", "--max-n", "2", "--max-logprobs", "2",
          "--max-num-seqs", "4", "--num-kv-blocks", "64", "--block-size", "16")


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    srv = start_server(tiny_llama, tmp_path_factory.mktemp("fuzz") / "log", *LIMITS,
                       served_model_name=MODEL)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


@pytest.fixture(scope="module")
def session():
    with requests.Session() as s:  # one connection: an error must not drop it
        yield s


def check_answer(response: "schemathesis.Response", route: str, body: object) -> None:
    where = f"{route} {json.dumps(body, default=repr)[:600]}"
    assert response.status_code < 500, f"{where}\n-> {response.status_code} {response.text[:600]}"
    if response.status_code >= 400:
        error = response.json()["error"]  # OpenAI's shape: {"error": {"message", "type", ...}}
        assert isinstance(error["message"], str) and error["message"], where
        assert isinstance(error["type"], str) and "param" in error and "code" in error, where
    elif "text/event-stream" in str(response.headers.get("content-type")):  # a list of values
        events = [line for line in response.text.splitlines() if line]
        assert events and all(e.startswith(("data: ", "event: ")) for e in events), where
    else:
        assert isinstance(response.json(), dict), where


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("route", ROUTES)
def test_fuzzed_requests_get_2xx_or_an_openai_4xx(server, schema, session, route, mode):
    operation = schema[route]["POST"]

    @settings(max_examples=EXAMPLES[mode], derandomize=True, database=None, deadline=None,
              phases=[Phase.generate, Phase.shrink], print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case) -> None:
        # requests raises ConnectionError when the server drops the keep-alive connection.
        response = case.call(base_url=server.url, session=session, timeout=30)
        check_answer(response, route, case.body)

    fuzz()


def test_a_choice_the_vocabulary_cannot_write_is_a_400(server, session):
    # Found by the fuzz: the byte-level tokenizer holds no token for some bytes of U+40000,
    # so the grammar's first mask was empty, a token was sampled anyway and the request
    # failed with a 500. Also with a regex, and a choice that dead-ends after a token.
    for field, value in (("guided_choice", ["\U00040000"]), ("guided_regex", "\U00040000+"),
                         ("guided_choice", ["b", "a\U00040000"])):
        body = {"model": MODEL, "prompt": "Pick:", "max_tokens": 4, field: value}
        response = session.post(server.url + "/v1/completions", json=body, timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert "cannot be written with this model's vocabulary" in error["message"], error
    body = {"model": MODEL, "prompt": "Pick:", "max_tokens": 4, "guided_choice": ["yes", "no"]}
    response = session.post(server.url + "/v1/completions", json=body, timeout=30)
    assert response.json()["choices"][0]["text"] in ("yes", "no"), response.text


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_dead_ends_later_fails_alone_saying_why(server, session, stream):
    # Only a later mask is empty ("b", then bytes no token holds): the request fails at that
    # step with the reason, not with "logits not finite", and the server goes on.
    body = {"model": MODEL, "prompt": "Pick:", "max_tokens": 8, "stream": stream,
            "guided_regex": "b\U00040000"}
    response = session.post(server.url + "/v1/completions", json=body, timeout=30)
    text = response.text
    assert "the grammar allows no token of this model's vocabulary" in text, text
    if not stream:
        assert response.status_code == 500 and response.json()["error"]["message"]
    body = {"model": MODEL, "prompt": "Pick:", "max_tokens": 4, "guided_choice": ["yes", "no"]}
    response = session.post(server.url + "/v1/completions", json=body, timeout=30)
    assert response.json()["choices"][0]["text"] in ("yes", "no"), response.text


@pytest.mark.parametrize("prompt", [[-1], [0, 2**40], [[5], [-3]]])
@pytest.mark.parametrize("extra", [{"echo": True}, {"use_beam_search": True}])
def test_bad_token_ids_are_a_400_on_every_path(server, session, prompt, extra):
    # Found by the fuzz: echo decoded the ids before the engine checked them, and beam
    # search's requests met the engine's check outside the route's error handling (500s).
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra}
    response = session.post(server.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "prompt"
    assert "token ids must be in" in response.json()["error"]["message"]


def test_the_server_answers_normally_after_the_fuzz(server, session, tiny_llama):
    model, prompts = hf_model_and_prompts(tiny_llama)
    want = hf_greedy(model, prompts[:1], 8)[0]
    body = {"model": MODEL, "prompt": prompts[0], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    response = session.post(server.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    assert response.json()["usage"]["completion_tokens"] == 8
    assert choice["text"] == tok.decode(want)  # transformers' greedy tokens
    assert httpx.get(server.url + "/health", timeout=5).json() == {"status": "ok"}
