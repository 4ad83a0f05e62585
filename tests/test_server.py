"""The OpenAI-compatible server.

Part one drives AsyncLLMEngine and the app in-process with a fake engine (batching, aborts,
failures). Part two starts the real `nanoserve serve` on a loopback port with a tiny random
Llama and talks to it with the official `openai` client and plain httpx.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from nanoserve.config import EngineConfig
from nanoserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError
from nanoserve.engine.llm_engine import EngineStats
from nanoserve.engine.request import sample_request_ids
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.sampling_params import SamplingParams

BOOM = 666  # a prompt holding this token makes the fake engine's step() raise
FAULT = 667  # a request whose prompt holds this token ends with "error" at its second token


class FakeEngine:
    """Stands in for LLMEngine: each step gives every request one more token."""

    max_model_len = 64
    model_name = "fake"
    tokenizer = None
    executor_alive = True
    config = EngineConfig()

    def __init__(self, step_s: float = 0.002) -> None:
        self.step_s = step_s
        self.live: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.aborted: list[str] = []
        self.max_batch = 0
        self.closed = False

    def add_request(self, request_id, prompt, params=None, arrival_time=None) -> None:
        params = params or SamplingParams()
        ids = sample_request_ids(request_id, params.n)
        if any(rid in self.live for rid in ids):
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt:
            raise ValueError("prompt must not be empty")
        for k, rid in enumerate(ids):
            self.live[rid] = (list(prompt), params.for_sample(k), [])

    def abort_request(self, request_ids) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            if rid in self.live and rid not in self.aborted:
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def step(self) -> list[RequestOutput]:
        outputs = [self._finish(rid, "abort") for rid in self.aborted]
        self.aborted = []
        if any(BOOM in prompt for prompt, _, _ in self.live.values()):
            raise RuntimeError("boom")
        self.max_batch = max(self.max_batch, len(self.live))
        time.sleep(self.step_s)
        for rid, (prompt, params, tokens) in list(self.live.items()):
            tokens.append(len(tokens) + 1)
            if FAULT in prompt and len(tokens) == 2:
                outputs.append(self._finish(rid, "error", "ValueError: injected fault"))
            elif len(tokens) >= params.max_tokens:
                outputs.append(self._finish(rid, "length"))
            else:
                outputs.append(self._output(rid, None))
        return outputs

    def _output(self, rid: str, finish: str | None, why: str | None = None) -> RequestOutput:
        prompt, _, tokens = self.live[rid]
        now = time.time()
        text = "".join(f" t{t}" for t in tokens)
        return RequestOutput(
            rid, None, prompt, [CompletionOutput(0, text, list(tokens), finish, why)],
            finish is not None,
            metrics={"arrival_time": now, "first_token_time": now, "last_token_time": now})

    def _finish(self, rid: str, reason: str, why: str | None = None) -> RequestOutput:
        out = self._output(rid, reason, why)
        del self.live[rid]
        return out

    def stats(self) -> EngineStats:
        fields = {f.name: 0 for f in dataclasses.fields(EngineStats)}
        return EngineStats(**{**fields, "num_running": len(self.live), "kv_cache_usage": 0.0})

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake():
    engine = FakeEngine()
    async_engine = AsyncLLMEngine(lambda: engine)
    async_engine.start()
    yield engine, async_engine
    async_engine.shutdown()
    assert engine.closed


async def _run(async_engine, rid, prompt, max_tokens) -> RequestOutput:
    stream = await async_engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens))
    async for out in stream:
        last = out
    return last


def test_async_engine_batches_concurrent_requests(fake):
    engine, async_engine = fake

    async def main():
        return await asyncio.gather(*(_run(async_engine, f"r{i}", [1, 2], 5 + i)
                                      for i in range(20)))

    finals = asyncio.run(main())
    assert [len(o.outputs[0].token_ids) for o in finals] == [5 + i for i in range(20)]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in finals)
    assert engine.max_batch > 1


def test_async_engine_refuses_bad_input_and_aborts(fake):
    engine, async_engine = fake

    async def main():
        with pytest.raises(ValueError, match="empty"):
            await async_engine.add_request("bad", [], SamplingParams())
        stream = await async_engine.add_request("long", [1], SamplingParams(max_tokens=10**6))
        with pytest.raises(ValueError, match="in use"):
            await async_engine.add_request("long", [1], SamplingParams())
        first = await stream.__anext__()
        stream.cancel()
        assert not first.finished
        for _ in range(200):  # the abort takes effect at the next step
            if not engine.live:
                break
            await asyncio.sleep(0.01)
        assert not engine.live and async_engine.stats.num_running == 0

    asyncio.run(main())


def test_samples_and_prompts_are_added_in_one_command_all_or_none(fake):
    engine, async_engine = fake

    async def main():
        streams = await async_engine.add_requests(
            [("a", [1], SamplingParams(n=40, max_tokens=2)), ("b", [2], SamplingParams(n=24))])
        assert [s.request_id for s in streams] == \
            [f"a-{k}" for k in range(40)] + [f"b-{k}" for k in range(24)]
        for stream in streams:
            async for out in stream:
                pass
        assert engine.max_batch == 64  # every sample was in the engine's first step
        keep = await async_engine.add_request("keep", [1], SamplingParams(max_tokens=10**6))
        with pytest.raises(ValueError, match="empty"):  # the second refused: neither is taken
            await async_engine.add_requests([("c", [1], SamplingParams(n=3)),
                                             ("d", [], SamplingParams())])
        with pytest.raises(ValueError, match="in use"):  # leaves the other "keep" alone
            await async_engine.add_requests([("e", [1], SamplingParams(n=2)),
                                             ("keep", [1], SamplingParams())])
        await keep.__anext__()
        for _ in range(200):  # the aborts take effect at the next step
            if set(engine.live) == {"keep"}:
                break
            await asyncio.sleep(0.01)
        assert set(engine.live) == {"keep"}
        keep.cancel()

    asyncio.run(main())


def test_step_failure_fails_in_flight_requests_only(fake):
    engine, async_engine = fake

    async def main():
        bystander = await async_engine.add_request("ok", [1], SamplingParams(max_tokens=10**6))
        await bystander.__anext__()
        with pytest.raises(RequestFailedError):
            await _run(async_engine, "bad", [BOOM], 3)
        with pytest.raises(RequestFailedError):
            async for _ in bystander:
                pass
        after = await _run(async_engine, "after", [1], 3)  # the engine keeps serving
        assert after.outputs[0].finish_reason == "length"

    asyncio.run(main())
    assert async_engine.is_running


def test_step_failure_that_kills_the_executor_stops_serving(fake):
    engine, async_engine = fake
    engine.executor_alive = False  # as a broken tensor-parallel group reports itself

    async def main():
        with pytest.raises(RequestFailedError):
            await _run(async_engine, "bad", [BOOM], 3)
        with pytest.raises(EngineDeadError):
            await async_engine.add_request("after", [1], SamplingParams())

    asyncio.run(main())
    async_engine._thread.join(5)
    assert not async_engine.is_running


def test_begin_shutdown_ends_streams_and_refuses_new(fake):
    _, async_engine = fake

    async def main():
        stream = await async_engine.add_request("a", [1], SamplingParams(max_tokens=10**6))
        await stream.__anext__()
        async_engine.begin_shutdown()
        async for out in stream:
            last = out
        assert last.outputs[0].finish_reason == "abort"
        with pytest.raises(EngineDeadError):
            await async_engine.add_request("b", [1], SamplingParams())

    asyncio.run(main())


def test_app_reports_engine_failure_per_request(fake):
    from nanoserve.entrypoints.server import build_app

    _, async_engine = fake
    app = build_app(async_engine, "fake")

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            url = "/v1/completions"
            failed = await client.post(url, json={"prompt": [BOOM], "max_tokens": 3})
            assert failed.status_code == 500 and "boom" in failed.json()["error"]["message"]
            streamed = await client.post(url, json={"prompt": [BOOM], "stream": True})
            events = [line for line in streamed.text.splitlines() if line]
            assert "error" in json.loads(events[-2][len("data: "):])
            assert events[-1] == "data: [DONE]"
            ok = await client.post(url, json={"prompt": [1, 2], "max_tokens": 3})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3

    asyncio.run(main())


@contextlib.contextmanager
def serve_in_thread(app) -> Iterator[str]:
    """``app`` served by uvicorn on a loopback port (a real socket) in a thread; its URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=_free_port(),
                                           log_level="critical"))
    thread = threading.Thread(target=server.run)
    thread.start()
    try:
        deadline = time.time() + 30
        while not server.started:
            assert thread.is_alive() and time.time() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


class BuggyTokenizer:
    """Fails as a bug would, with a message that is not even valid Unicode (a lone surrogate)."""

    def encode(self, *args, **kwargs):
        raise TypeError("tokenizer bug \ud800")


def _local_port(response: httpx.Response) -> int:
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


def test_health_answers_json_and_503_once_shutting_down(fake):
    from nanoserve.entrypoints.server import build_app

    _, async_engine = fake
    with serve_in_thread(build_app(async_engine, "fake")) as url:
        up = httpx.get(url + "/health")
        assert (up.status_code, up.headers["content-type"], up.json()) == \
            (200, "application/json", {"status": "ok"})
        async_engine.begin_shutdown()
        down = httpx.get(url + "/health")
        assert (down.status_code, down.json()) == (503, {"status": "unavailable"})


def test_unexpected_error_is_a_500_body_on_a_kept_connection(fake):
    """uvicorn closes a keep-alive connection on any exception an app lets out, and starlette's
    handler for Exception re-raises after answering: the app must answer the error itself."""
    from nanoserve.entrypoints.server import build_app

    engine, async_engine = fake
    engine.tokenizer = BuggyTokenizer()
    with serve_in_thread(build_app(async_engine, "fake")) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        failed = http.post("/tokenize", json={"prompt": "x"})
        port = _local_port(failed)
        assert failed.status_code == 500
        error = failed.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "internal_server_error" and "tokenizer bug" in error["message"]
        ok = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        assert _local_port(ok) == port, "the 500 dropped the connection"


def test_app_fails_only_the_request_at_fault(fake):
    from nanoserve.entrypoints.server import build_app

    engine, async_engine = fake
    engine.step_s = 0.03  # the faulty ones fail at their second step: after all six were added
    app = build_app(async_engine, "fake")

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            url = "/v1/completions"
            body = {"prompt": [1, 2], "max_tokens": 30}
            failed, streamed, *ok = await asyncio.gather(
                client.post(url, json={**body, "prompt": [FAULT]}),
                client.post(url, json={**body, "prompt": [FAULT], "stream": True}),
                *(client.post(url, json=body) for _ in range(4)))
            assert failed.status_code == 500
            assert "injected fault" in failed.json()["error"]["message"]
            events = [line for line in streamed.text.splitlines() if line]
            assert "injected fault" in json.loads(events[-2][len("data: "):])["error"]["message"]
            assert events[-1] == "data: [DONE]" and "t1" in events[0]  # a token, then the error
            for response in ok:
                assert response.status_code == 200
                assert response.json()["usage"]["completion_tokens"] == 30
            assert engine.max_batch == 6  # all ran side by side

    asyncio.run(main())


# ---- a real server ---------------------------------------------------------------------------

API_KEY = "sk-nanoserve-test"
MODEL = "tiny-llama"


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        """SIGINT, as from a terminal: the server must exit 0 within 30 s (killed if not)."""
        self.proc.send_signal(signal.SIGINT)
        try:
            assert self.proc.wait(30) == 0, self.log_tail()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: Path, log: Path, *extra: str,
                 served_model_name: str | None = MODEL) -> Server:
    port = _free_port()
    name = ["--served-model-name", served_model_name] if served_model_name else []
    cmd = [sys.executable, "-m", "nanoserve.entrypoints.cli", "serve", str(model),
           "--port", str(port), "--device", "cpu", "--dtype", "float32",
           "--num-kv-blocks", "256", *name, "--log-level", "warning", *extra]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", proc, log)
    deadline = time.time() + 120
    while time.time() < deadline:
        assert proc.poll() is None, f"server exited early:\n{server.log_tail()}"
        try:
            if httpx.get(server.url + "/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"server never became healthy:\n{server.log_tail()}")


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    srv = start_server(tiny_llama, tmp_path_factory.mktemp("server") / "log",
                       "--api-key", API_KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def metric_values(http: httpx.Client) -> dict[str, float]:
    values = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("nanoserve:"):
            name, value = line.rsplit(" ", 1)
            values[name.replace(f'model_name="{MODEL}"', "").replace("{}", "")
                   .replace("{,", "{").replace(",}", "}")] = float(value)
    return values


def wait_idle(http: httpx.Client, timeout: float = 10.0) -> dict[str, float]:
    """Metrics once no request runs or waits and the whole KV cache is free."""
    deadline = time.time() + timeout
    while True:
        values = metric_values(http)
        idle = (values["nanoserve:num_requests_running"] == 0
                and values["nanoserve:num_requests_waiting"] == 0
                and values["nanoserve:kv_cache_usage_perc"] == 0)
        if idle or time.time() > deadline:
            return values
        time.sleep(0.05)


def test_completion_stream_equals_full(client, tokenizer):
    prompt = "The capital of France is"
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kwargs))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full.choices[0].text and streamed
    assert full.choices[0].finish_reason == "length"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    n_prompt = len(tokenizer.encode(prompt))
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) \
        == (n_prompt, 12, n_prompt + 12)
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_chat_stream_equals_full(client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a colour."}]
    kwargs = dict(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content and streamed
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    expected = tokenizer.apply_chat_template(messages, tokenize=True,
                                             add_generation_prompt=True)["input_ids"]
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(expected), 10)
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_stop_strings_and_batch_prompts(client):
    full = client.completions.create(model=MODEL, prompt=["Hello", "Bye"], max_tokens=6,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in full.choices] == [0, 1]
    assert full.usage.completion_tokens == 12
    ids = client.completions.create(model=MODEL, prompt=[[1, 2, 3], [4, 5]], max_tokens=2)
    assert ids.usage.prompt_tokens == 5 and len(ids.choices) == 2
    text = full.choices[0].text
    stop = text[2:5]
    if stop.strip():  # the random model's text may be mostly spaces; then skip this part
        cut = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6,
                                        temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True})
        assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text


def test_n_samples_are_the_seeded_single_requests(client):
    """n = 3 with a seed gives choices 0-2 equal to three requests seeded seed, seed+1, seed+2;
    with two prompts, choice i * 3 + k is prompt i's sample k."""
    kwargs = dict(model=MODEL, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    full = client.completions.create(prompt=["Hello", "Bye"], n=3, seed=11, **kwargs)
    assert [c.index for c in full.choices] == list(range(6))
    prompt_tokens = 0
    for i, prompt in enumerate(["Hello", "Bye"]):
        alone = [client.completions.create(prompt=prompt, seed=11 + k, **kwargs)
                 for k in range(3)]
        assert [full.choices[i * 3 + k].text for k in range(3)] == \
            [a.choices[0].text for a in alone]
        prompt_tokens += alone[0].usage.prompt_tokens
    assert len({c.text for c in full.choices[:3]}) > 1, "three samples, one text: not sampled"
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (prompt_tokens, 6 * 8)


def test_chat_n_samples_stream_equals_full(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                  max_completion_tokens=8, temperature=1.0, n=2, seed=3,
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    assert [c.index for c in full.choices] == [0, 1]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == [c.message.content for c in full.choices]
    roles = {c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"}
    assert roles == {0, 1}


def test_beam_search_equals_the_offline_search(client, tiny_llama):
    """vLLM's use_beam_search: n beams per prompt, best first, as LLM.beam_search finds them."""
    from nanoserve import LLM, BeamSearchParams

    prompts = ["Hello", "The sky is"]
    full = client.completions.create(model=MODEL, prompt=prompts, n=3, max_tokens=5,
                                     extra_body={"use_beam_search": True, "ignore_eos": True,
                                                 "length_penalty": 0.5})
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", num_kv_blocks=256)
    offline = llm.beam_search(prompts, BeamSearchParams(3, 5, ignore_eos=True,
                                                        length_penalty=0.5))
    llm.close()
    assert [c.text for c in full.choices] == [h.text for out in offline for h in out.sequences]
    assert [c.index for c in full.choices] == list(range(6))
    assert {c.finish_reason for c in full.choices} == {"length"}
    assert full.usage.completion_tokens == 6 * 5
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2, max_completion_tokens=3,
        extra_body={"use_beam_search": True})
    assert [c.index for c in chat.choices] == [0, 1]


def test_completion_logprobs_are_the_engines_and_stream_whole(client, tiny_llama, tokenizer):
    from nanoserve import LLM, SamplingParams

    kwargs = dict(model=MODEL, prompt="The sky is", max_tokens=6, temperature=0, logprobs=3,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", num_kv_blocks=256)
    ours = llm.generate("The sky is", SamplingParams(temperature=0, max_tokens=6, logprobs=3,
                                                     ignore_eos=True), use_tqdm=False)[0]
    llm.close()
    ids, engine = ours.outputs[0].token_ids, ours.outputs[0].logprobs
    lp = full.choices[0].logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs == pytest.approx([e[t] for t, e in zip(ids, engine)], abs=1e-5)
    for top, e in zip(lp.top_logprobs, engine):
        best = sorted(e.values(), reverse=True)[:3]
        assert sorted(top.values(), reverse=True) == pytest.approx(best[:len(top)], abs=1e-5)
    # Greedy: each token is its step's most likely one.
    assert lp.token_logprobs == pytest.approx([max(t.values()) for t in lp.top_logprobs])
    lengths = [len(t) for t in lp.tokens]
    assert lp.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]
    chunks = list(client.completions.create(stream=True, **kwargs))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((c.tokens for c in streamed), []) == lp.tokens
    assert sum((c.token_logprobs for c in streamed), []) == lp.token_logprobs
    assert sum((c.text_offset for c in streamed), []) == lp.text_offset


def test_echo_repeats_the_prompt_with_its_logprobs(client, tiny_llama, tokenizer):
    """lm-eval's loglikelihood request: echo + logprobs give every prompt token's logprob."""
    from nanoserve import LLM, SamplingParams

    kwargs = dict(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0, logprobs=2,
                  echo=True, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    plain = client.completions.create(**{**kwargs, "echo": False})
    choice = full.choices[0]
    assert choice.text == "The sky is" + plain.choices[0].text
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", num_kv_blocks=256)
    ours = llm.generate("The sky is", SamplingParams(temperature=0, max_tokens=4,
                                                     prompt_logprobs=2, ignore_eos=True),
                        use_tqdm=False)[0]
    llm.close()
    prompt = ours.prompt_token_ids
    lp = choice.logprobs
    assert lp.tokens[:len(prompt)] == [tokenizer.decode([t]) for t in prompt]
    assert lp.tokens[len(prompt):] == plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(prompt)] == pytest.approx(
        [e[t] for t, e in zip(prompt[1:], ours.prompt_logprobs[1:])], abs=1e-5)
    assert lp.token_logprobs[len(prompt):] == pytest.approx(
        plain.choices[0].logprobs.token_logprobs, abs=1e-6)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])
    lengths = [len(t) for t in lp.tokens]
    assert lp.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]
    # Streamed: the first chunk opens with the prompt; the pieces add up to the full choice.
    chunks = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert chunks[0].choices[0].text.startswith("The sky is")
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert sum((c.tokens for c in streamed), []) == lp.tokens
    assert sum((c.token_logprobs for c in streamed), []) == lp.token_logprobs
    # A token prompt echoes as its decoded text.
    ids = tokenizer.encode("Hello there")
    echoed = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, echo=True)
    assert echoed.choices[0].text.startswith(tokenizer.decode(ids))


def test_prompt_logprobs_in_vllms_shape(client, tokenizer):
    full = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=2,
                                     extra_body={"prompt_logprobs": 1})
    entries = full.choices[0].model_extra["prompt_logprobs"]
    prompt = tokenizer.encode("The sky is")
    assert len(entries) == len(prompt) and entries[0] is None
    for token, entry in zip(prompt[1:], entries[1:]):
        assert str(token) in entry and 1 <= len(entry) <= 2
        assert entry[str(token)]["decoded_token"] == tokenizer.decode([token])
        assert entry[str(token)]["logprob"] <= 0
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=2,
        extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat.model_extra["prompt_logprobs"][1:])
    plain = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=2)
    assert "prompt_logprobs" not in plain.choices[0].model_extra
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert info.value.body["param"] == "prompt_logprobs"


def test_best_of_keeps_the_likeliest_samples(client):
    kwargs = dict(model=MODEL, prompt="The sky is", max_tokens=5, temperature=1.0, seed=11,
                  extra_body={"ignore_eos": True})
    ranked = client.completions.create(best_of=3, n=2, **kwargs)
    singles = [client.completions.create(logprobs=0, **{**kwargs, "seed": 11 + k})
               for k in range(3)]
    score = {c.choices[0].text: sum(c.choices[0].logprobs.token_logprobs) for c in singles}
    assert len(set(score)) == 3, "the samples should differ"
    best = sorted(score, key=score.get, reverse=True)[:2]
    assert [c.text for c in ranked.choices] == best
    assert [c.index for c in ranked.choices] == [0, 1]
    assert all(c.logprobs is None for c in ranked.choices)  # not asked for
    assert ranked.usage.completion_tokens == 3 * 5  # every sample generated counts
    for bad in ({"best_of": 1, "n": 2}, {"best_of": 2, "stream": True}):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(**{**kwargs, **bad})
        assert info.value.body["param"] == "best_of"


def test_logit_bias_and_allowed_tokens_steer_the_tokens(client, tokenizer):
    token = tokenizer.encode(" blue", add_special_tokens=False)[-1]
    kwargs = dict(model=MODEL, max_tokens=4, temperature=0, logprobs=1,
                  logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    out = client.completions.create(prompt="The sky is", **kwargs)
    assert out.choices[0].logprobs.tokens == [tokenizer.decode([token])] * 4
    # The reported logprobs are the model's own, before the bias (vLLM's default).
    assert max(out.choices[0].logprobs.token_logprobs) < -1
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=3,
        temperature=0, logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == tokenizer.decode([token] * 3)
    allowed = tokenizer.encode(" red green", add_special_tokens=False)
    restricted = client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=6, temperature=1.0, seed=4, logprobs=0,
        extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    assert set(restricted.choices[0].logprobs.tokens) <= {tokenizer.decode([t]) for t in allowed}
    for bias, fragment in (({"abc": 1}, "token ids"), ({str(token): 101}, "[-100, 100]"),
                           ({str(10 ** 9): 1}, "must be in [0, ")):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(prompt="x", **{**kwargs, "logit_bias": bias})
        assert info.value.body["param"] == "logit_bias" and fragment in info.value.message


def test_truncate_prompt_tokens_keeps_the_end(client, tokenizer):
    ids = list(range(100, 2100))  # longer than the test server's context
    kwargs = dict(model=MODEL, max_tokens=3, temperature=0, echo=True,
                  extra_body={"ignore_eos": True, "truncate_prompt_tokens": 40})
    out = client.completions.create(prompt=ids, **kwargs)
    assert out.usage.prompt_tokens == 40
    assert out.choices[0].text.startswith(tokenizer.decode(ids[-40:]))
    same = client.completions.create(model=MODEL, prompt=ids[-40:], max_tokens=3, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert out.choices[0].text.endswith(same.choices[0].text)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(prompt=ids, **{**kwargs, "extra_body": {}})
    assert info.value.body["param"] == "prompt"


def test_chat_logprobs_stream_equals_full(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                  max_completion_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens == 6
    for token in content:
        assert 1 <= len(token.top_logprobs) <= 2
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob)  # greedy
        assert token.bytes == list(token.token.encode())
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    # The second request reads the first's prompt blocks from the prefix cache, so its
    # prefill runs other shapes: the same tokens, logprobs equal to float rounding.
    assert [t.token for t in streamed] == [t.token for t in content]
    for got, want in zip(streamed, content):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [t.token for t in got.top_logprobs] == [t.token for t in want.top_logprobs]
        assert [t.logprob for t in got.top_logprobs] == pytest.approx(
            [t.logprob for t in want.top_logprobs], abs=1e-5)
    plain = client.chat.completions.create(**{**kwargs, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_fifty_concurrent_streams(server):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, str, int, str]:
        stream = await client.completions.create(
            model=MODEL, prompt=f"Request number {i}:", max_tokens=4 + i % 9, temperature=0.8,
            seed=i, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        text, finish, usage = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        return 4 + i % 9, text, usage.completion_tokens, finish

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(50)))

    results = asyncio.run(main())
    assert len(results) == 50
    for wanted, text, got, finish in results:
        assert got == wanted and finish == "length" and text


def test_cancel_mid_stream_frees_everything(http):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 480,
            "ignore_eos": True, "stream": True}
    aborted = 'nanoserve:request_success_total{finished_reason="abort"}'
    for _ in range(5):
        before = metric_values(http)
        with http.stream("POST", "/v1/completions", json=body) as response:
            chunks, busy = 0, None
            for line in response.iter_lines():
                chunks += line.startswith("data: ")
                if chunks == 3:
                    # Read while the stream is open: leaving the loop finalises iter_lines'
                    # generator, which closes the connection, and the server's abort could
                    # then beat this request for the metrics.
                    busy = metric_values(http)
                    break
        # the connection is closed mid-stream
        after = wait_idle(http)
        if busy is not None and busy["nanoserve:num_requests_running"] == 1:
            break
        # On a loaded machine the engine may generate all 480 tokens before three chunks get
        # here (the stream buffers them): nothing was left to cancel, so try again.
        assert after.get(aborted, 0) == before.get(aborted, 0)
    else:
        pytest.fail(f"the request never showed as running while streamed: {busy}")
    assert busy["nanoserve:kv_cache_usage_perc"] > 0
    assert after["nanoserve:num_requests_running"] == 0
    assert after["nanoserve:kv_cache_usage_perc"] == 0
    assert after[aborted] == before.get(aborted, 0) + 1

    # a non-streaming request whose client gives up is aborted too
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={**body, "stream": False}, timeout=0.5)
    after = wait_idle(http)
    assert after["nanoserve:kv_cache_usage_perc"] == 0
    assert after[aborted] == before.get(aborted, 0) + 2


def test_many_samples_are_one_add_and_abort_together(client, http):
    """n = 64 goes to the engine at once (not one sample per engine step), its samples sharing
    the prompt's blocks; a client that leaves takes every sample of its request with it."""
    prompt = "The samples of this prompt share its first blocks " * 3
    start = time.perf_counter()
    many = client.completions.create(model=MODEL, prompt=prompt, n=64, max_tokens=1,
                                     temperature=1.0, extra_body={"ignore_eos": True})
    elapsed = time.perf_counter() - start
    assert [c.index for c in many.choices] == list(range(64))
    assert many.usage.completion_tokens == 64
    one = 0.0  # the slower of two requests of one sample, on this machine as loaded now
    for end in "!?":
        one_start = time.perf_counter()
        client.completions.create(model=MODEL, prompt=prompt + end, max_tokens=1)
        one = max(one, time.perf_counter() - one_start)
    # Added one per engine step, the 64 took 30-50 times one request's time here.
    assert elapsed < 10 * one + 2.0, (elapsed, one)

    aborted = 'nanoserve:request_success_total{finished_reason="abort"}'
    body = {"model": MODEL, "prompt": prompt, "n": 8, "max_tokens": 480, "ignore_eos": True}
    before = wait_idle(http)
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        for chunks, line in enumerate(response.iter_lines()):
            if chunks == 20:
                busy = metric_values(http)
                break
    after = wait_idle(http)
    assert busy["nanoserve:num_requests_running"] == 8, busy
    assert after["nanoserve:num_requests_running"] == 0
    assert after["nanoserve:kv_cache_usage_perc"] == 0
    assert after[aborted] == before.get(aborted, 0) + 8
    with pytest.raises(httpx.ReadTimeout):  # not streamed: the client gives up
        http.post("/v1/completions", json=body, timeout=0.5)
    after = wait_idle(http)
    assert after["nanoserve:kv_cache_usage_perc"] == 0
    assert after[aborted] == before.get(aborted, 0) + 16


LONG_PROMPT = "word " * 600  # more tokens than max_model_len (512)


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, None),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "3"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", b'{"prompt": "x", "temperature": 1e309}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "x", "repetition_penalty": 1e309}', 400,
     "repetition_penalty"),
    ("/v1/completions", b'{"prompt": "x", "frequency_penalty": -1e309}', 400,
     "frequency_penalty"),
    ("/v1/completions", b'{"prompt": "x", "use_beam_search": true, "length_penalty": 1e309}',
     400, "length_penalty"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
     b'"top_p": -1e309}', 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "seed": "s"}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "stop": 3}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 11, "use_beam_search": True}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 10**6}, 400, "n"),  # past --max-n
    ("/v1/completions", {"prompt": "x", "best_of": 129}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),  # --max-logprobs
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 129},
     400, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "stream": True}, 400, "stream"),
    ("/v1/completions", {"prompt": "", "max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**7]}, 400, "prompt"),
    ("/v1/completions", {"prompt": LONG_PROMPT}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 600}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "model": "nope"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "top_k": 1.5}, 400, "top_k"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]},
     400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 600}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 500}, 400, "max_tokens"),
    ("/detokenize", {"tokens": [-5]}, 400, "tokens"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    # A lone surrogate (JSON's "\ud800" escape; json.dumps writes one so) in any text.
    ("/v1/completions", {"prompt": "a\ud800b"}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "a\udfffb"]}, 400, "prompt[1]"),
    ("/v1/completions", {"prompt": "x", "stop": ["\ud800"]}, 400, "stop[0]"),
    ("/v1/completions", {"prompt": "x", "model": "a\ud800b"}, 400, "model"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"\ud800": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800"}]},
     400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a\ud800"}]}]},
     400, "messages[0].content[0].text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f", "description": "\ud800"}}]},
     400, "tools[0].function.description"),
    ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {
            "name": "f", "arguments": '{"a": "\ud800"}'}}]}]},
     400, "messages[1].tool_calls[0].function.arguments"),
    ("/tokenize", {"prompt": "a\ud800b"}, 400, "prompt"),
])
def test_bad_input_is_a_400_naming_the_field(http, path, body, status, param):
    if not isinstance(body, bytes):
        body = json.dumps(body).encode()
    response = http.post(path, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


def test_api_key_is_enforced(server, http):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.get(server.url + "/v1/models", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "x"}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong",
                      max_retries=0).models.list()
    for open_path in ("/health", "/metrics", "/version"):
        assert httpx.get(server.url + open_path).status_code == 200
    assert http.get("/v1/models").status_code == 200


def test_info_endpoints(client, http, tokenizer):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert http.get("/version").json()["version"]
    tokens = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["tokens"] == tokenizer.encode("Hello world")
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "Hello world"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 5


def test_openapi_declares_the_request_bodies(http):
    spec = http.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for path, model in (("/v1/completions", "CompletionRequest"),
                        ("/v1/chat/completions", "ChatCompletionRequest"),
                        ("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")):
        body = spec["paths"][path]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"] == \
            {"$ref": f"#/components/schemas/{model}"}
    assert "prompt" in schemas["CompletionRequest"]["required"]
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    refs = re.findall(r'"\$ref": "([^"]+)"', json.dumps(spec))
    assert refs and all(ref.removeprefix("#/components/schemas/") in schemas for ref in refs)
    docs = http.get("/docs")
    assert docs.status_code == 200 and "swagger-ui" in docs.text
    # Bad bodies still get OpenAI's 400 naming the field, not FastAPI's 422.
    bad = http.post("/v1/completions", json={"prompt": "x", "max_tokens": "3"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_metrics_move_with_traffic(client, http, tokenizer):
    before = wait_idle(http)
    prompt = "Counting tokens"
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    after = wait_idle(http)

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert delta("nanoserve:prompt_tokens_total") == len(tokenizer.encode(prompt))
    assert delta("nanoserve:generation_tokens_total") == 5
    assert delta("nanoserve:prefix_cache_queries_total") > 0
    assert delta('nanoserve:request_success_total{finished_reason="length"}') == 1
    assert delta("nanoserve:time_to_first_token_seconds_count") == 1
    assert delta("nanoserve:inter_token_latency_seconds_count") == 4
    assert delta("nanoserve:e2e_request_latency_seconds_count") == 1
    assert delta("nanoserve:request_queue_time_seconds_count") == 1
    assert "nanoserve:num_preemptions_total" in after


def _descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def test_sigterm_ends_in_flight_requests_and_exits(tiny_llama, tmp_path):
    srv = start_server(tiny_llama, tmp_path / "log", "--shutdown-timeout", "0")  # no drain
    children = _descendants(srv.proc.pid)
    events: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {"prompt": "Long story", "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line:
                    events.append(line)
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        assert started.wait(30), srv.log_tail()
        srv.proc.send_signal(signal.SIGTERM)
        reader.join(30)
        assert not reader.is_alive()
        assert srv.proc.wait(30) == 0, srv.log_tail()
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: "):])
    assert last["choices"][0]["finish_reason"] in ("abort", "length")
    assert len(events) < 480  # it ended early rather than running to max_tokens
    for pid in children:
        assert not os.path.exists(f"/proc/{pid}") or \
            "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
