"""Streaming answers: engine outputs of one HTTP request as OpenAI server-sent events."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import AsyncIterator

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from nanoserve.engine.request_stream import RequestStream
from nanoserve.entrypoints.errors import APIError
from nanoserve.entrypoints.logprobs import Decode, chat_logprobs, completion_logprobs
from nanoserve.entrypoints.bodies import (
    ChatChunkChoice, ChatCompletionChunk, CompletionChoice, CompletionResponse, DeltaMessage,
    DeltaToolCall, UsageInfo)
from nanoserve.entrypoints.chat_answer import AnswerParts, AnswerStream
from nanoserve.outputs import RequestOutput

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event carrying ``payload`` as JSON."""
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body generator when it ends: on a disconnect
    the generator may be left suspended, its ``finally`` (which aborts the requests and so
    frees their KV blocks) pending until garbage collection."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def cancel_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.cancel()


@dataclass
class _Sent:
    """What one choice's chunks have carried so far."""

    answer: AnswerStream  # its text, split into reasoning, content and tool calls
    tokens: int = 0  # tokens whose logprobs went out
    offset: int = 0  # completions' text_offset of the next token
    opened: bool = False  # the choice's first chunk went out (with the echoed prompt)


class ChunkWriter:
    """Turns the cumulative outputs of a request's streams into OpenAI SSE chunks."""

    def __init__(self, request_id: str, model: str, chat: bool, include_usage: bool,
                 samples_per_prompt: int = 1, top_logprobs: int | None = None,
                 decode: Decode | None = None, echo: list[str] | None = None,
                 tool_calls: bool = False, reasoning_parser: str | None = None):
        """``echo``: each prompt's text, which opens its choices' first chunk (completions);
        ``tool_calls``: parse chat answers for them (sent in the last chunk);
        ``reasoning_parser``: send chat answers' thinking as ``reasoning_content``."""
        self.request_id, self.model, self.chat = request_id, model, chat
        self.tool_calls, self.reasoning_parser = tool_calls, reasoning_parser
        self.include_usage = include_usage
        self.samples_per_prompt = samples_per_prompt
        self.top_logprobs, self.decode = top_logprobs, decode
        self.echo = echo
        self.created = int(time.time())

    async def events(self, streams: list[RequestStream]) -> AsyncIterator[str]:
        sent = [_Sent(AnswerStream(self.tool_calls, self.reasoning_parser)) for _ in streams]
        finals: list[RequestOutput] = []
        try:
            if self.chat:  # every choice opens with the assistant's role
                for i in range(len(streams)):
                    yield sse(self._chat_chunk(i, DeltaMessage(role="assistant", content=""),
                                               None))
            async with contextlib.aclosing(merge_streams(streams)) as outputs:
                async for i, out in outputs:
                    completion = out.outputs[0]
                    new = sent[i].answer.advance(completion.text, out.finished)
                    finish_reason = "tool_calls" if new.tool_calls else completion.finish_reason
                    if self.echo is not None and not sent[i].opened:
                        new.content = self.echo[i // self.samples_per_prompt] + new.content
                    if new.content or new.reasoning or finish_reason:
                        yield sse(self._chunk(i, new, finish_reason,
                                              self._logprobs_since(sent[i], out)))
                        sent[i].opened = True
                    if out.finished:
                        finals.append(out)
            if self.include_usage:
                yield sse(self._usage_chunk(UsageInfo.from_outputs(finals,
                                                                   self.samples_per_prompt)))
            yield SSE_DONE
        except Exception as exc:  # a failed request ends its stream with an error event
            yield sse(APIError(str(exc), status=500, type="internal_server_error").body())
            yield SSE_DONE
        finally:
            cancel_all(streams)  # on disconnect (GeneratorExit/cancel) this aborts them

    def _logprobs_since(self, sent: _Sent, out: RequestOutput) -> BaseModel | None:
        """The logprobs of every token since the choice's last chunk (the echoed prompt's
        first); None unless the request asked for logprobs."""
        completion = out.outputs[0]
        if self.top_logprobs is None or completion.logprobs is None:
            return None
        new = completion.token_ids[sent.tokens:]
        logprobs = completion.logprobs[sent.tokens:]
        sent.tokens = len(completion.token_ids)
        if self.echo is not None and not sent.opened:
            new, logprobs = out.prompt_token_ids + new, out.prompt_logprobs + logprobs
        if self.chat:
            return chat_logprobs(new, logprobs, self.top_logprobs, self.decode)
        chunk = completion_logprobs(new, logprobs, self.top_logprobs, self.decode, sent.offset)
        sent.offset += sum(map(len, chunk.tokens))
        return chunk

    def _chunk(self, index: int, new: AnswerParts, finish_reason: str | None,
               logprobs: BaseModel | None) -> BaseModel:
        if self.chat:
            calls = [DeltaToolCall(index=k, **call.model_dump())
                     for k, call in enumerate(new.tool_calls)]
            delta = DeltaMessage(content=new.content or None,
                                 reasoning_content=new.reasoning or None, tool_calls=calls or None)
            return self._chat_chunk(index, delta, finish_reason, logprobs)
        return CompletionResponse(id=self.request_id, model=self.model, created=self.created,
                                  choices=[CompletionChoice(index=index, text=new.content,
                                                            logprobs=logprobs,
                                                            finish_reason=finish_reason)])

    def _chat_chunk(self, index: int, delta: DeltaMessage, finish_reason: str | None,
                    logprobs: BaseModel | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.request_id, model=self.model, created=self.created,
            choices=[ChatChunkChoice(index=index, delta=delta, logprobs=logprobs,
                                     finish_reason=finish_reason)])

    def _usage_chunk(self, usage: UsageInfo) -> BaseModel:
        """The extra last chunk of ``stream_options.include_usage``: no choices, only usage."""
        kind = ChatCompletionChunk if self.chat else CompletionResponse
        return kind(id=self.request_id, model=self.model, created=self.created, choices=[],
                    usage=usage)


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:  # the common case needs no tasks
        async for out in streams[0]:
            yield 0, out
        return
    pending = {asyncio.ensure_future(streams[i].__anext__()): i for i in range(len(streams))}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                out = task.result()
                yield i, out
                if not out.finished:
                    pending[asyncio.ensure_future(streams[i].__anext__())] = i
    finally:
        for task in pending:
            task.cancel()
