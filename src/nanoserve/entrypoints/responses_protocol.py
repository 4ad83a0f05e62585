"""OpenAI's Responses API (``POST /v1/responses``): the request, its translation into a chat
request for the engine, and the response object and output items, as plain JSON."""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import Field

from nanoserve.entrypoints.chat_answer import AnswerParts
from nanoserve.entrypoints.errors import APIError
from nanoserve.entrypoints.protocol import _Strict
from nanoserve.outputs import RequestOutput


class ContentPart(_Strict):
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(_Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(_Strict):  # passed back by clients; the model's thinking is not re-read
    type: Literal["reasoning"]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: dict[str, Any] | None = None

    def input_messages(self) -> list[dict[str, Any]]:
        """``input`` as chat messages: function calls become an assistant's tool calls,
        their outputs tool messages; a developer is a system."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                content = item.content if isinstance(item.content, str) else \
                    "\n".join(part.text for part in item.content)
                role = "system" if item.role == "developer" else item.role
                messages.append({"role": role, "content": content})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id,
                                 "content": item.output})
        if not messages:
            raise APIError("input must hold a message", param="input")
        return messages

    def chat_body(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat completions body this request runs as."""
        body: dict[str, Any] = {"messages": messages, "max_completion_tokens":
                                self.max_output_tokens, "temperature": self.temperature,
                                "top_p": self.top_p, "user": self.user}
        if self.tools:
            body["tools"] = [{"type": "function", "function": tool.model_dump(
                exclude_none=True, exclude={"type", "strict"})} for tool in self.tools]
        if isinstance(self.tool_choice, dict):
            if self.tool_choice.get("type") != "function" or "name" not in self.tool_choice:
                raise APIError('tool_choice must be "auto", "none", "required" or '
                               '{"type": "function", "name": ...}', param="tool_choice")
            body["tool_choice"] = {"type": "function",
                                   "function": {"name": self.tool_choice["name"]}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        body["response_format"] = self._response_format()
        return {k: v for k, v in body.items() if v is not None}

    def _response_format(self) -> dict[str, Any] | None:
        fmt = (self.text or {}).get("format") or {"type": "text"}
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema":
            return {"type": "json_schema", "json_schema": {
                "name": fmt.get("name", "schema"), "schema": fmt.get("schema")}}
        raise APIError("text.format.type must be text, json_object or json_schema",
                       param="text.format.type")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if text or \
        status == "completed" else []
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": content}


def function_call_item(call_id: str, name: str, arguments: str,
                       item_id: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call_id,
            "name": name, "arguments": arguments, "status": "completed"}


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def output_items(parts: AnswerParts) -> list[dict[str, Any]]:
    """A whole answer's output items: reasoning, the message, then each function call."""
    items = [reasoning_item(new_id("rs"), parts.reasoning)] if parts.reasoning else []
    if parts.content or not parts.tool_calls:
        items.append(message_item(new_id("msg"), parts.content or ""))
    items += [function_call_item(c.id, c.function.name, c.function.arguments)
              for c in parts.tool_calls]
    return items


def response_body(response_id: str, req: ResponsesRequest, model: str, created: float,
                  output: list[dict[str, Any]], final: RequestOutput | None = None,
                  status: str = "completed") -> dict[str, Any]:
    """The Response object; ``final``: the finished engine output (its usage, its finish)."""
    incomplete = None
    usage = None
    if final is not None:
        if final.outputs[0].finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        prompt, answer = len(final.prompt_token_ids), len(final.outputs[0].token_ids)
        usage = {"input_tokens": prompt,
                 "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
                 "output_tokens": answer, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": prompt + answer}
    return {
        "id": response_id, "object": "response", "created_at": created, "model": model,
        "status": status, "error": None, "incomplete_details": incomplete,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {}, "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "tool_choice": req.tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
        "truncation": "disabled", "store": req.store is not False, "user": req.user,
        "usage": usage}


def as_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the chat messages a later turn continues from."""
    content = "".join(part["text"] for item in output if item["type"] == "message"
                      for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    return [{"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}]


def now() -> float:
    return float(int(time.time()))
