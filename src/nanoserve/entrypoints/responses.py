"""OpenAI API response bodies (whole and streamed) as pydantic models."""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from nanoserve.entrypoints.logprobs import ChatLogprobs, CompletionLogprobs, PromptLogprobs
from nanoserve.entrypoints.tool_calls import ToolCall
from nanoserve.outputs import RequestOutput


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
