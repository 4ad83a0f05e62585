"""Server pieces that need no model: request parsing and errors, SSE chunks, metrics."""
from __future__ import annotations

import dataclasses

import pytest

from nanoserve.config import EngineConfig
from nanoserve.engine.llm_engine import EngineStats
from nanoserve.engine.metrics import ServerMetrics
from nanoserve.entrypoints.constraints import requested_constraint
from nanoserve.entrypoints.errors import APIError, parse_request
from nanoserve.entrypoints.protocol import (
    ChatCompletionRequest, CompletionRequest, value_error_to_api)
from nanoserve.entrypoints.bodies import (
    ChatChunkChoice, ChatCompletionChunk, DeltaMessage, UsageInfo)
from nanoserve.outputs import CompletionOutput, RequestOutput


def _error(model, body) -> APIError:
    with pytest.raises(APIError) as info:
        request = parse_request(model, body)
        request.check_supported(EngineConfig())
        constraint = requested_constraint(request)
        request.sampling_params(getattr(request, "max_tokens", None), constraint and constraint[0])
    return info.value


def test_valid_completion_request_maps_to_sampling_params():
    req = parse_request(CompletionRequest, {
        "prompt": "hi", "max_tokens": 7, "temperature": 0, "top_p": 0.9, "top_k": 5,
        "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "repetition_penalty": 1.2, "seed": 3, "stop": "x", "stop_token_ids": [2],
        "ignore_eos": True, "min_tokens": 1, "user": "u", "n": 1, "unknown_extra": 1})
    req.check_supported(EngineConfig())
    params = req.sampling_params(req.max_tokens)
    assert (params.max_tokens, params.temperature, params.top_k, params.stop_strings) == \
        (7, 0.0, 5, ["x"])
    assert params.ignore_eos and params.seed == 3 and params.stop_token_ids == [2]


def test_defaults_are_openai_defaults():
    params = parse_request(CompletionRequest, {"prompt": [1, 2]}).sampling_params(16)
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.max_tokens == 16
    chat = parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                                 "max_tokens": 3, "max_completion_tokens": 5})
    assert chat.max_new_tokens() == 5


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": "7"}, "max_tokens"),        # wrong type, no coercion
    ({"prompt": "x", "max_tokens": 7.0}, "max_tokens"),
    ({"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": -0.1}, "temperature"),     # out of range
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "min_p": 2}, "min_p"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop": ["a", 3]}, "stop[1]"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 1.5}, "n"),
    ({"prompt": "x", "n": 129}, "n"),  # past the engine's max_n
    ({"prompt": "x", "best_of": 129}, "best_of"),
    ({"prompt": "x", "echo": True, "use_beam_search": True}, "echo"),
    ({"prompt": "x", "best_of": 1, "n": 2}, "best_of"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"1": 200}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"-3": 1}}, "logit_bias"),
    ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": "x", "allowed_token_ids": [-2]}, "allowed_token_ids"),
    ({"prompt": "x", "response_format": {"type": "yaml"}}, "response_format"),
    ({"prompt": "x", "guided_choice": []}, "guided_choice"),
    ({"prompt": "x", "guided_json": {}, "response_format": {"type": "json_object"}},
     "guided_json"),
    ({"prompt": "x", "best_of": 0}, "best_of"),
    ({"prompt": "x", "best_of": 3, "stream": True}, "best_of"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"prompt": ["a", 1]}, "prompt[1]"),
    ({"prompt": 5}, "prompt"),
    ({}, "prompt"),
])
def test_bad_completion_fields_are_named(body, param):
    error = _error(CompletionRequest, body)
    assert error.status == 400 and error.param == param, error.message


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "always"},
     "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "two words"}}]},
     "tools[0].function.name"),
    ({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools[0].function.parameters"),
    ({"messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
])
def test_bad_chat_fields_are_named(body, param):
    error = _error(ChatCompletionRequest, body)
    assert error.status == 400 and error.param == param, error.message


def test_limits_are_the_engines_options():
    config = EngineConfig(max_n=4, max_logprobs=30)
    chat = {"messages": [{"role": "user", "content": "x"}], "logprobs": True}
    for model, body, param in ((CompletionRequest, {"prompt": "x", "n": 5}, "n"),
                               (CompletionRequest, {"prompt": "x", "best_of": 5}, "best_of"),
                               (CompletionRequest, {"prompt": "x", "logprobs": 31}, "logprobs"),
                               (ChatCompletionRequest, {**chat, "n": 5}, "n"),
                               (ChatCompletionRequest, {**chat, "top_logprobs": 31},
                                "top_logprobs")):
        with pytest.raises(APIError) as info:
            parse_request(model, body).check_supported(config)
        assert info.value.param == param and "(the server's --max-" in info.value.message
    parse_request(CompletionRequest, {"prompt": "x", "n": 4, "logprobs": 30}
                  ).check_supported(config)
    parse_request(ChatCompletionRequest, {**chat, "top_logprobs": 30}).check_supported(config)


def test_body_must_be_an_object():
    assert _error(CompletionRequest, [1, 2]).param is None


def test_value_errors_name_known_fields_only():
    assert value_error_to_api(ValueError("top_p must be in (0, 1]")).param == "top_p"
    assert value_error_to_api(ValueError("prompt must not be empty"), "messages").param \
        == "messages"
    assert value_error_to_api(ValueError("request needs 9 KV cache blocks")).param is None


def test_error_body_has_openai_shape():
    body = APIError("bad", param="top_p").body()
    assert body == {"error": {"message": "bad", "type": "invalid_request_error",
                              "param": "top_p", "code": None}}


def test_chat_chunk_omits_unset_delta_fields():
    chunk = ChatCompletionChunk(id="c", created=1, model="m", choices=[
        ChatChunkChoice(index=0, delta=DeltaMessage(content="hi"), finish_reason=None)])
    data = chunk.model_dump()
    assert data["choices"][0]["delta"] == {"content": "hi"} and "usage" not in data


def test_text_parts_join_for_the_template():
    req = parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "bob"}]})
    assert req.messages[0].as_template_dict() == {"role": "user", "content": "a\nb",
                                                  "name": "bob"}


def _output(rid: str, n_tokens: int, t: float, finish: str | None = None) -> RequestOutput:
    times = {"arrival_time": 0.0, "first_scheduled_time": 0.5}
    if n_tokens:
        times.update(first_token_time=1.0, last_token_time=t)
    if finish:
        times["finished_time"] = t
    return RequestOutput(rid, None, [1, 2], [CompletionOutput(0, "", [7] * n_tokens, finish)],
                         finish is not None, metrics=times)


def test_metrics_follow_stats_and_outputs():
    fields = {f.name: 0 for f in dataclasses.fields(EngineStats)
              if f.default is dataclasses.MISSING}
    stats = EngineStats(**{**fields, **dict(
        num_running=2, num_waiting=1, kv_cache_usage=0.25, num_free_blocks=3,
        num_total_blocks=4, prefix_cache_queries=10, prefix_cache_hits=4, num_preemptions=1,
        prompt_tokens=10, generation_tokens=5)})
    metrics = ServerMetrics("m", lambda: stats)
    for out in (_output("a", 1, 1.0), _output("a", 2, 1.5), _output("a", 3, 2.5, "length"),
                _output("b", 0, 0.0, "abort")):
        metrics.observe(out)
    text = metrics.render()[0].decode()

    def value(sample: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith(sample + " "))
        return float(line.rsplit(" ", 1)[1])

    label = '{model_name="m"}'
    assert value(f"nanoserve:num_requests_running{label}") == 2
    assert value(f"nanoserve:num_requests_waiting{label}") == 1
    assert value(f"nanoserve:kv_cache_usage_perc{label}") == 0.25
    assert value(f"nanoserve:prefix_cache_hits_total{label}") == 4
    assert value(f"nanoserve:num_preemptions_total{label}") == 1
    assert value(f"nanoserve:generation_tokens_total{label}") == 5
    assert value('nanoserve:request_success_total{finished_reason="length",model_name="m"}') == 1
    assert value('nanoserve:request_success_total{finished_reason="abort",model_name="m"}') == 1
    assert value(f"nanoserve:time_to_first_token_seconds_count{label}") == 1
    assert value(f"nanoserve:time_to_first_token_seconds_sum{label}") == 1.0
    assert value(f"nanoserve:inter_token_latency_seconds_count{label}") == 2
    assert value(f"nanoserve:inter_token_latency_seconds_sum{label}") == 1.5
    assert value(f"nanoserve:e2e_request_latency_seconds_count{label}") == 2
    assert value(f"nanoserve:request_queue_time_seconds_sum{label}") == 1.0


def test_serve_command_and_async_engine_need_no_web_packages():
    """The GPU box has no fastapi/uvicorn: registering `serve` must not import them."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "for name in ('fastapi', 'uvicorn', 'starlette', 'prometheus_client'):\n"
        "    sys.modules[name] = None  # any import of them now fails\n"
        "import argparse\n"
        "import nanoserve.engine.async_engine\n"
        "from nanoserve.entrypoints.serve_command import add_serve_parser\n"
        "parser = argparse.ArgumentParser()\n"
        "add_serve_parser(parser.add_subparsers())\n"
        "args = parser.parse_args(['serve', 'some/model', '--port', '9000'])\n"
        "assert args.model_tag == 'some/model' and args.port == 9000\n"
        "assert args.host == '127.0.0.1'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("model,body", [
    (CompletionRequest, {"prompt": "hi", "use_beam_search": True, "n": 4, "stream": True}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                             "use_beam_search": True, "stream": True}),
])
def test_beam_search_does_not_stream(model, body):
    error = _error(model, body)
    assert error.param == "stream" and "use_beam_search" in error.message
    parse_request(model, {**body, "stream": False}).check_supported(EngineConfig())


def test_n_samples_reach_sampling_params_and_count_the_prompt_once():
    req = parse_request(CompletionRequest, {"prompt": "hi", "n": 3, "seed": 7})
    req.check_supported(EngineConfig())
    params = req.sampling_params(5)
    assert params.n == 3
    assert [params.for_sample(k).seed for k in range(3)] == [7, 8, 9]
    assert all(params.for_sample(k).n == 1 for k in range(3))
    finals = [RequestOutput(str(k), None, [1, 2, 3, 4],
                            [CompletionOutput(0, "x", [5] * (k + 1), "length")], True)
              for k in range(3)]
    usage = UsageInfo.from_outputs(finals, samples_per_prompt=3)
    assert (usage.prompt_tokens, usage.completion_tokens) == (4, 6)


def test_logprobs_reach_sampling_params():
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert parse_request(ChatCompletionRequest, chat).sampling_params(4).logprobs is None
    asked = parse_request(ChatCompletionRequest, {**chat, "logprobs": True, "top_logprobs": 3})
    asked.check_supported(EngineConfig())
    assert asked.sampling_params(4).logprobs == 3
    assert parse_request(ChatCompletionRequest, {**chat, "logprobs": True}
                         ).sampling_params(4).logprobs == 0
    assert parse_request(CompletionRequest, {"prompt": "x", "logprobs": 5}
                         ).sampling_params(4).logprobs == 5
