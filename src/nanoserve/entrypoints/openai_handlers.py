"""The OpenAI endpoints' logic: requests in, engine requests out, and back as OpenAI bodies.
Imported lazily by the server (it needs starlette), never by the engine."""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from nanoserve.engine.async_engine import AsyncLLMEngine
from nanoserve.engine.chat import render_chat
from nanoserve.engine.request_stream import RequestStream
from nanoserve.entrypoints.constraints import requested_constraint
from nanoserve.entrypoints.errors import APIError, parse_request
from nanoserve.entrypoints.logprobs import choice_logprobs, prompt_logprobs_out
from nanoserve.entrypoints.protocol import (
    ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest, TokenizeRequest,
    check_template_kwargs, value_error_to_api)
from nanoserve.entrypoints.bodies import UsageInfo, full_response
from nanoserve.entrypoints.streaming import ChunkWriter, ClosingStreamingResponse, cancel_all
from nanoserve.entrypoints.tool_calls import ForcedToolCalls
from nanoserve.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.prompts import (ContextLengthError, as_prompt_list, check_context_length,
                               truncate_prompt)
from nanoserve.sampling_params import SamplingParams

T = TypeVar("T")


class OpenAIServing:
    """Serves completions, chat completions, tokenize and detokenize for one model;
    ``reasoning_parser``: split chat answers' thinking into ``reasoning_content``;
    ``request_timeout``: seconds from arrival after which a request is aborted."""

    def __init__(self, engine: AsyncLLMEngine, served_model_name: str,
                 reasoning_parser: str | None = None, request_timeout: float | None = None):
        self.engine = engine
        self.served_model_name = served_model_name
        self.reasoning_parser = reasoning_parser
        self.request_timeout = request_timeout
        # Prompts are tokenized (and chats rendered) off the event loop, so a huge one leaves
        # health checks and streams answering; one thread, so a burst queues there.
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="nanoserve-tokenize")

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn,
                                                                *args)

    def _time_left(self, arrival: float) -> float | None:
        return None if self.request_timeout is None else \
            self.request_timeout - (time.time() - arrival)

    def check_model(self, model: str | None, generates: bool = False) -> None:
        """A 404 for another model's name; with ``generates``, a 400 from an embedding model."""
        if model is not None and model != self.served_model_name:
            raise APIError(f"The model `{model}` does not exist.", status=404, param="model",
                           code="model_not_found")
        if generates and self.engine.config.task == "embed":
            raise APIError("this model makes embeddings (--task embed): use /v1/embeddings",
                           param="model")

    async def completions(self, body: Any, request: Request) -> Response:
        arrival = time.time()
        req: CompletionRequest = parse_request(CompletionRequest, body)
        self.check_model(req.model, generates=True)
        req.check_supported(self.engine.config)
        given = as_prompt_list(req.prompt)
        if not given:
            raise APIError("prompt must not be empty", param="prompt")
        # Tokenized here rather than in the engine so length errors can name the field.
        whole = given if not any(isinstance(p, str) for p in given) else await self._off_loop(
            lambda: [self.engine.tokenizer.encode(p) if isinstance(p, str) else p
                     for p in given])
        prompts, params = self._params(req, req.max_tokens, whole, "prompt", "max_tokens")
        echo = self._echo_texts(given, whole, prompts) if req.echo else None
        return await self._generate(f"cmpl-{uuid.uuid4().hex}", prompts, params, req, arrival,
                                    request, chat=False, echo=echo)

    async def chat(self, body: Any, request: Request) -> Response:
        arrival = time.time()
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, body)
        self.check_model(req.model, generates=True)
        req.check_supported(self.engine.config)
        prompt = await self._off_loop(self._render_chat, req.messages,
                                      bool(req.add_generation_prompt), req.tools_offered(),
                                      req.chat_template_kwargs)
        max_field = "max_completion_tokens" if req.max_completion_tokens is not None \
            else "max_tokens"
        prompts, params = self._params(req, req.max_new_tokens(), [prompt], "messages",
                                       max_field)
        return await self._generate(f"chatcmpl-{uuid.uuid4().hex}", prompts, params, req,
                                    arrival, request, chat=True)

    async def tokenize(self, body: Any) -> dict[str, Any]:
        req: TokenizeRequest = parse_request(TokenizeRequest, body)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            check_template_kwargs(req.chat_template_kwargs)
            tokens = await self._off_loop(lambda: self._render_chat(
                req.messages, bool(req.add_generation_prompt),
                template_kwargs=req.chat_template_kwargs))
        else:
            tokens = await self._off_loop(lambda: self.engine.tokenizer.encode(
                req.prompt, add_special_tokens=bool(req.add_special_tokens)))
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.engine.max_model_len}

    def detokenize(self, body: Any) -> dict[str, Any]:
        req: DetokenizeRequest = parse_request(DetokenizeRequest, body)
        self.check_model(req.model)
        vocab = len(self.engine.tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"tokens must be in [0, {vocab}), got {bad[:5]}", param="tokens")
        return {"prompt": self.engine.tokenizer.decode(req.tokens)}

    def _echo_texts(self, given: list[Any], whole: list[list[int]],
                    prompts: list[list[int]]) -> list[str]:
        """As vLLM's, an echo repeats a text prompt as given, a token or truncated one decoded.
        Token ids are checked first: the engine would refuse them, but only after the decode
        here failed on them (a negative id overflows the tokenizer's)."""
        vocab = self.engine.vocab_size
        for ids in prompts:
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise APIError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}",
                               param="prompt")
        return [text if isinstance(text, str) and kept is ids else self._decode(kept)
                for text, ids, kept in zip(given, whole, prompts)]

    def _decode(self, token_ids: list[int]) -> str:
        return self.engine.tokenizer.decode(token_ids)

    def _render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                     tools: list[dict[str, Any]] | None = None,
                     template_kwargs: dict[str, Any] | None = None) -> list[int]:
        tokenizer = self.engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise APIError("this model has no chat template; use /v1/completions",
                           param="messages")
        try:
            return render_chat(tokenizer, [m.as_template_dict() for m in messages],
                               add_generation_prompt, tools, template_kwargs)
        except Exception as exc:  # templates reject bad conversations by raising
            raise APIError(f"the chat template rejected the messages: {exc}",
                           param="messages") from None

    def _params(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                prompts: list[list[int]], prompt_field: str, max_field: str
                ) -> tuple[list[list[int]], SamplingParams]:
        """The request's SamplingParams and its prompts as the engine will run them
        (truncated, when asked): a bad value or an over-long prompt is a 400 naming it."""
        constraint = requested_constraint(req)
        if constraint is not None and req.use_beam_search:
            raise APIError("use_beam_search cannot be constrained", param=constraint[1])
        try:
            params = req.sampling_params(max_tokens, constraint and constraint[0])
        except APIError as error:
            if error.param == "max_tokens" and max_field != "max_tokens":
                raise APIError(error.message.replace("max_tokens", max_field, 1),
                               param=max_field) from None
            raise
        prompts = [truncate_prompt(ids, params.truncate_prompt_tokens, self.engine.max_model_len)
                   for ids in prompts]
        for ids in prompts:
            if not ids:
                raise APIError(f"{prompt_field} must not be empty", param=prompt_field)
            try:  # the engine checks too, but only here is it known which field to name
                check_context_length(len(ids), max_tokens, self.engine.max_model_len)
            except ContextLengthError as exc:
                raise APIError(f"{exc}; shorten the {prompt_field} or lower {max_field}.",
                               param=prompt_field if exc.prompt_too_long else max_field
                               ) from None
        return prompts, params

    async def _compile_grammar(self, params: SamplingParams,
                               req: CompletionRequest | ChatCompletionRequest) -> None:
        """Wait, off the event loop and the engine thread, for the request's grammar; one
        that does not compile is a 400 naming the field that asked for it."""
        if params.structured_outputs is not None:
            try:
                await self.engine.compile_grammar(params.structured_outputs)
            except ValueError as exc:
                raise APIError(str(exc), param=requested_constraint(req)[1]) from None

    async def _generate(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                        req: CompletionRequest | ChatCompletionRequest, arrival: float,
                        request: Request, chat: bool, echo: list[str] | None = None
                        ) -> Response:
        """``echo``: each prompt's text, to begin its choices' text (completions)."""
        await self._compile_grammar(params, req)
        if req.use_beam_search:
            return await self._beam_search(request_id, prompts, params, req, arrival, request,
                                           chat)
        # One engine request per prompt, in one add: stream i * n + k is prompt i's sample k.
        # With best_of, the n of highest cumulative logprob (the engine then reports it) kept.
        samples = req.samples_per_prompt()
        engine_params = params if samples == params.n else \
            dataclasses.replace(params, n=samples, logprobs=params.logprobs or 0)
        rids = [request_id] if len(prompts) == 1 else \
            [f"{request_id}-{i}" for i in range(len(prompts))]
        try:
            streams = await self.engine.add_requests(
                [(rid, ids, engine_params) for rid, ids in zip(rids, prompts)], arrival,
                self._time_left(arrival))
        except ValueError as exc:
            raise value_error_to_api(exc, "messages" if chat else "prompt") from None
        if req.stream:
            events = ChunkWriter(request_id, self.served_model_name, chat, req.include_usage(),
                                 params.n, params.logprobs, self._decode, echo,
                                 tool_calls=_parses_tool_calls(req),
                                 reasoning_parser=self.reasoning_parser if chat else None
                                 ).events(streams)
            return ClosingStreamingResponse(events, media_type="text/event-stream",
                                            headers={"Cache-Control": "no-cache"})
        finals = await _unless_disconnected(request, _collect(streams))
        if finals is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        usage = UsageInfo.from_outputs(finals, samples)  # every sample generated counts
        if samples != params.n:
            finals = [best for i in range(len(prompts))
                      for best in _best(finals[i * samples:(i + 1) * samples], params.n)]
        outs = [o.outputs[0] for o in finals]
        if echo is not None:
            outs = [dataclasses.replace(o, text=echo[i // params.n] + o.text)
                    for i, o in enumerate(outs)]
        logprobs = [choice_logprobs(f, chat, params.logprobs, self._decode, echo is not None)
                    for f in finals]
        prompt_logprobs = None if req.prompt_logprobs is None else \
            [prompt_logprobs_out(f, req.prompt_logprobs, self._decode) for f in finals]
        body = full_response(request_id, self.served_model_name, chat, outs, usage, logprobs,
                             prompt_logprobs, _parses_tool_calls(req), self.reasoning_parser)
        return Response(body.model_dump_json(), media_type="application/json")

    async def _beam_search(self, request_id: str, prompts: list[list[int]],
                           params: SamplingParams, req: CompletionRequest | ChatCompletionRequest,
                           arrival: float, request: Request, chat: bool) -> Response:
        """vLLM's ``use_beam_search``: each step's ``n`` beams per prompt go to the engine as
        requests; the choices are each prompt's beams, best first."""
        max_tokens = params.max_tokens or self.engine.max_model_len - max(map(len, prompts))
        try:
            beam_params = BeamSearchParams(params.n, max_tokens, params.ignore_eos,
                                           req.length_penalty)
        except ValueError as exc:
            field = "length_penalty" if "length_penalty" in str(exc) else "n"
            raise APIError(str(exc).replace("beam_width", "n"), param=field) from None
        search = BeamSearch(prompts, beam_params, self.engine.eos_token_ids)
        decode = self.engine.tokenizer.decode

        async def run() -> list[BeamSearchOutput]:
            step = 0
            while not search.done:
                try:
                    streams = await self.engine.add_requests(
                        [(f"{request_id}-step{step}-beam{j}", ids, search.step_params)
                         for j, ids in enumerate(search.requests())], arrival,
                        self._time_left(arrival))
                except ValueError as exc:  # as in _generate: the engine's refusal is a 400
                    raise value_error_to_api(exc, "messages" if chat else "prompt") from None
                search.advance([f.outputs[0].logprobs[0] for f in await _collect(streams)])
                step += 1
            return search.results(lambda ids: decode(ids, skip_special_tokens=True))

        results = await _unless_disconnected(request, run())
        if results is None:
            return Response(status_code=499)
        beams = [h for out in results for h in out.sequences]
        outs = [CompletionOutput(i, h.text, h.token_ids, "stop" if h.finished else "length",
                                 h.token_ids[-1] if h.finished else None)
                for i, h in enumerate(beams)]
        prompt_tokens = sum(map(len, prompts))
        completion_tokens = sum(len(h.token_ids) for h in beams)
        usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          total_tokens=prompt_tokens + completion_tokens)
        body = full_response(request_id, self.served_model_name, chat, outs, usage,
                             [None] * len(outs), tool_calls=_parses_tool_calls(req),
                             reasoning_parser=self.reasoning_parser)
        return Response(body.model_dump_json(), media_type="application/json")


def _parses_tool_calls(req: CompletionRequest | ChatCompletionRequest
                       ) -> bool | ForcedToolCalls:
    """How chat answers become tool calls: forced by tool_choice, parsed (True), or not."""
    if not isinstance(req, ChatCompletionRequest):
        return False
    return req.forced_tool_calls() or req.offers_tools()


def _best(samples: list[RequestOutput], n: int) -> list[RequestOutput]:
    """The ``n`` samples of highest cumulative logprob, best first (``best_of``)."""
    def score(final: RequestOutput) -> float:
        out = final.outputs[0]
        return sum(lps[t] for t, lps in zip(out.token_ids, out.logprobs, strict=True))

    return sorted(samples, key=score, reverse=True)[:n]


async def _collect(streams: list[RequestStream]) -> list[RequestOutput]:
    finals: list[RequestOutput] = []
    try:
        for stream in streams:
            async for out in stream:
                if out.finished:
                    finals.append(out)
    finally:
        cancel_all(streams)  # no-op for finished ones; aborts the rest on error or cancel
    return finals


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work``, cancelling it if the client disconnects first (then return None)."""

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        task.cancel()  # no-op when done; else its streams get aborted as it unwinds
    return task.result() if task in done else None
