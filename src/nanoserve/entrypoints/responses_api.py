"""``POST /v1/responses``: a Responses request runs as a chat request through the same
pipeline as /v1/chat/completions; its answer goes out as output items, whole or as typed
server-sent events; finished responses are kept (bounded) for ``previous_response_id``."""
from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from nanoserve.engine.request_stream import RequestStream
from nanoserve.entrypoints.chat_answer import AnswerStream, split_answer
from nanoserve.entrypoints.errors import APIError, parse_request
from nanoserve.entrypoints.openai_handlers import OpenAIServing, _collect, _unless_disconnected
from nanoserve.entrypoints.protocol import ChatCompletionRequest, value_error_to_api
from nanoserve.entrypoints.responses_protocol import (
    ResponsesRequest, as_messages, function_call_item, message_item, new_id, now,
    output_items, reasoning_item, response_body)
from nanoserve.entrypoints.streaming import ClosingStreamingResponse
from nanoserve.outputs import RequestOutput

STORED_RESPONSES = 1024  # most responses kept for previous_response_id (oldest dropped)


class ResponsesServing:
    """Serves the Responses API on top of ``serving`` (the chat pipeline: template, sampling
    parameters, constraints, tool-call and reasoning parsing) with an in-memory store."""

    def __init__(self, serving: OpenAIServing, max_stored: int = STORED_RESPONSES):
        self.serving = serving
        self.max_stored = max_stored
        # id -> (the Response object, the conversation up to and including its answer)
        self.store: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = \
            OrderedDict()

    def retrieve(self, response_id: str) -> dict[str, Any]:
        if response_id not in self.store:
            raise APIError(f"no response with id {response_id!r}", status=404,
                           type="not_found_error", param="response_id")
        return self.store[response_id][0]

    async def create(self, body: Any, request: Request) -> Response:
        serving = self.serving
        req: ResponsesRequest = parse_request(ResponsesRequest, body)
        serving.check_model(req.model, generates=True)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            if req.previous_response_id not in self.store:
                raise APIError(f"no stored response with id {req.previous_response_id!r}",
                               param="previous_response_id")
            history = list(self.store[req.previous_response_id][1])
        conversation = history + req.input_messages()
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        chat: ChatCompletionRequest = _renamed(lambda: parse_request(
            ChatCompletionRequest, req.chat_body(system + conversation)))
        chat.check_supported(serving.engine.config)
        prompt = await _renamed_async(serving._off_loop(
            serving._render_chat, chat.messages, True, chat.tools_offered()))
        prompts, params = _renamed(lambda: serving._params(
            chat, chat.max_new_tokens(), [prompt], "input", "max_output_tokens"))
        await serving._compile_grammar(params, chat)
        response_id, arrival = new_id("resp"), now()
        try:
            stream, = await serving.engine.add_requests([(response_id, prompts[0], params)],
                                                        arrival, serving._time_left(arrival))
        except ValueError as exc:
            raise value_error_to_api(exc, "input") from None
        tool_calls = chat.forced_tool_calls() or chat.offers_tools()
        reasoning = serving.reasoning_parser
        if req.stream:
            events = _Events(self, req, response_id, arrival, conversation)
            return ClosingStreamingResponse(
                events.run(stream, AnswerStream(tool_calls, reasoning)),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        finals = await _unless_disconnected(request, _collect([stream]))
        if finals is None:
            return Response(status_code=499)
        final = finals[0]
        parts = split_answer(final.outputs[0].text, tool_calls, reasoning)
        body = response_body(response_id, req, serving.served_model_name, arrival,
                             output_items(parts), final)
        self.keep(req, body, conversation)
        return Response(json.dumps(body), media_type="application/json")

    def keep(self, req: ResponsesRequest, body: dict[str, Any],
             conversation: list[dict[str, Any]]) -> None:
        if req.store is False:
            return
        self.store[body["id"]] = (body, conversation + as_messages(body["output"]))
        while len(self.store) > self.max_stored:
            self.store.popitem(last=False)


class _Events:
    """One streamed response: response.created, the output items opened, their deltas and
    their ends (reasoning, the message, each function call), then response.completed."""

    def __init__(self, serving: ResponsesServing, req: ResponsesRequest, response_id: str,
                 created: float, conversation: list[dict[str, Any]]):
        self.serving, self.req, self.conversation = serving, req, conversation
        self.response_id, self.created = response_id, created
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item whose text streams now

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def body(self, final: RequestOutput | None = None, status: str = "in_progress"
             ) -> dict[str, Any]:
        return response_body(self.response_id, self.req,
                             self.serving.serving.served_model_name, self.created,
                             list(self.output), final, status)

    def text_events(self, kind: str, text: str) -> list[str]:
        """``text`` added to an item of ``kind`` (reasoning or message), opening it first."""
        if not text:
            return []
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self.close()
            item = reasoning_item(new_id("rs"), "") if kind == "reasoning" else \
                message_item(new_id("msg"), "", status="in_progress")
            self.open, self.output = item, self.output + [item]
            events.append(self.event("response.output_item.added", output_index=self.index,
                                     item={**item, "content": []}))
            if kind == "message":
                item["content"] = [{"type": "output_text", "text": "", "annotations": []}]
                events.append(self.event("response.content_part.added", **self.where,
                                         part=item["content"][0]))
        self.open["content"][0]["text"] += text
        delta = "response.reasoning_text.delta" if kind == "reasoning" else \
            "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return events + [self.event(delta, **self.where, delta=text, **extra)]

    @property
    def index(self) -> int:
        return len(self.output) - 1

    @property
    def where(self) -> dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": self.index, "content_index": 0}

    def close(self) -> list[str]:
        item, events = self.open, []
        if item is None:
            return events
        text = item["content"][0]["text"]
        if item["type"] == "message":
            item["status"] = "completed"
            events += [self.event("response.output_text.done", **self.where, text=text,
                                  logprobs=[]),
                       self.event("response.content_part.done", **self.where,
                                  part=item["content"][0])]
        else:
            events.append(self.event("response.reasoning_text.done", **self.where, text=text))
        self.open = None
        return events + [self.event("response.output_item.done", output_index=self.index,
                                    item=item)]

    async def run(self, stream: RequestStream, answer: AnswerStream) -> AsyncIterator[str]:
        try:
            yield self.event("response.created", response=self.body())
            yield self.event("response.in_progress", response=self.body())
            final = None
            async for out in stream:
                parts = answer.advance(out.outputs[0].text, out.finished)
                for event in self.text_events("reasoning", parts.reasoning or ""):
                    yield event
                for event in self.text_events("message", parts.content or ""):
                    yield event
                if out.finished:
                    final = out
                    for event in self.close():
                        yield event
                    for call in parts.tool_calls:
                        for event in self.call_events(call.id, call.function.name,
                                                      call.function.arguments):
                            yield event
            if not any(item["type"] == "message" for item in self.output) and \
                    not any(item["type"] == "function_call" for item in self.output):
                self.output.append(message_item(new_id("msg"), ""))  # an empty answer
            body = self.body(final, "completed")
            self.serving.keep(self.req, body, self.conversation)
            done = "response.incomplete" if body["status"] == "incomplete" else \
                "response.completed"
            yield self.event(done, response=body)
        except Exception as exc:  # a failed request: its response failed, with the error
            body = self.body(status="failed")
            body["error"] = {"code": "server_error", "message": str(exc)}
            yield self.event("response.failed", response=body)
        finally:
            stream.cancel()  # on disconnect (GeneratorExit/cancel) this aborts it

    def call_events(self, call_id: str, name: str, arguments: str) -> list[str]:
        item = function_call_item(call_id, name, arguments)
        self.output.append(item)
        where = {"item_id": item["id"], "output_index": self.index}
        return [self.event("response.output_item.added", output_index=self.index,
                           item={**item, "arguments": "", "status": "in_progress"}),
                self.event("response.function_call_arguments.delta", **where, delta=arguments),
                self.event("response.function_call_arguments.done", **where,
                           arguments=arguments, name=name),
                self.event("response.output_item.done", output_index=self.index, item=item)]


def _rename(error: APIError) -> APIError:
    """The chat pipeline's field names as the Responses request's."""
    names = {"messages": "input", "max_completion_tokens": "max_output_tokens",
             "max_tokens": "max_output_tokens", "response_format": "text.format"}
    param = error.param or ""
    head = param.split(".", 1)[0].split("[", 1)[0]
    if head in names:
        error.message = error.message.replace(head, names[head], 1)
        error.param = names[head] + param[len(head):] if head != "messages" else "input"
    return error


def _renamed(fn: Any) -> Any:
    try:
        return fn()
    except APIError as error:
        raise _rename(error) from None


async def _renamed_async(awaitable: Any) -> Any:
    try:
        return await awaitable
    except APIError as error:
        raise _rename(error) from None

