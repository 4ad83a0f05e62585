"""OpenAI API response bodies, whole and streamed, as pydantic models."""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from nanoserve.entrypoints.chat_answer import split_answer
from nanoserve.entrypoints.logprobs import ChatLogprobs, CompletionLogprobs, PromptLogprobs
from nanoserve.entrypoints.tool_calls import ToolCall
from nanoserve.outputs import CompletionOutput, RequestOutput


def _unset_if_none() -> Any:
    return Field(default=None, exclude_if=lambda v: v is None)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def from_outputs(cls, finals: list[RequestOutput], samples_per_prompt: int = 1) -> UsageInfo:
        """Usage of a request's finished engine requests, ``samples_per_prompt`` of them for
        each prompt (its ``n``): a prompt counts once, as vLLM and OpenAI count it."""
        prompt = sum(len(o.prompt_token_ids) for o in finals) // samples_per_prompt
        completion = sum(len(o.outputs[0].token_ids) for o in finals)
        return cls(prompt_tokens=prompt, completion_tokens=completion,
                   total_tokens=prompt + completion)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = _unset_if_none()


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = _unset_if_none()


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = _unset_if_none()  # with a reasoning parser (vLLM's name)
    tool_calls: list[ToolCall] | None = _unset_if_none()


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = _unset_if_none()


class DeltaToolCall(ToolCall):
    """A whole tool call in one streamed delta (OpenAI streams may split one over several)."""

    index: int


class DeltaMessage(BaseModel):
    role: str | None = _unset_if_none()
    content: str | None = _unset_if_none()
    reasoning_content: str | None = _unset_if_none()
    tool_calls: list[DeltaToolCall] | None = _unset_if_none()


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = _unset_if_none()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "nanoserve"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def chat_message(out: CompletionOutput, tool_calls: bool, reasoning_parser: str | None
                 ) -> tuple[ChatMessageOut, str | None]:
    """A chat choice's message and finish reason ('tool_calls' when it calls some)."""
    parts = split_answer(out.text, tool_calls, reasoning_parser)
    message = ChatMessageOut(content=parts.content, reasoning_content=parts.reasoning,
                             tool_calls=parts.tool_calls or None)
    return message, "tool_calls" if parts.tool_calls else out.finish_reason


def full_response(request_id: str, model: str, chat: bool, outs: list[CompletionOutput],
                  usage: UsageInfo, logprobs: list[BaseModel | None],
                  prompt_logprobs: list[PromptLogprobs] | None = None,
                  tool_calls: bool = False, reasoning_parser: str | None = None) -> BaseModel:
    """A finished request's body; ``logprobs`` and ``prompt_logprobs`` (None: not asked for)
    per choice, though chat's one prompt carries them once."""
    if chat:
        messages = [chat_message(o, tool_calls, reasoning_parser) for o in outs]
        return ChatCompletionResponse(
            id=request_id, model=model, usage=usage,
            prompt_logprobs=prompt_logprobs[0] if prompt_logprobs else None,
            choices=[ChatChoice(index=i, message=message, logprobs=lp, finish_reason=finish,
                                stop_reason=o.stop_reason)
                     for i, (o, lp, (message, finish))
                     in enumerate(zip(outs, logprobs, messages, strict=True))])
    return CompletionResponse(
        id=request_id, model=model, usage=usage,
        choices=[CompletionChoice(index=i, text=o.text, logprobs=lp,
                                  finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                                  prompt_logprobs=None if prompt_logprobs is None
                                  else prompt_logprobs[i])
                 for i, (o, lp) in enumerate(zip(outs, logprobs, strict=True))])
