"""OpenAI's error body, turning invalid request JSON into a 400 that names the field, and
the last line of defence that answers any other failure as a 500 in that shape."""
from __future__ import annotations

import json
import logging
import re
from typing import Any

from pydantic import BaseModel, ValidationError


class APIError(Exception):
    """An error answered to the client as OpenAI's ``{"error": {...}}`` body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = (
            message, status, param, type, code)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def json(self) -> bytes:
        """The body as JSON, ASCII-escaped: it may quote the request's text, which need not
        encode as UTF-8 (a lone surrogate), and an error body must always go out."""
        return json.dumps(self.body()).encode()


def parse_json(raw: bytes) -> Any:
    """Decode a request body; anything but strict JSON is a 400."""
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, NaN, nesting
        raise APIError(f"the request body is not valid JSON: {exc}") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} (NaN / Infinity) is not valid JSON")


def parse_request(model: type[BaseModel], data: Any) -> Any:
    """Validate decoded JSON against ``model``; a failure becomes a 400 naming the field."""
    if not isinstance(data, dict):
        raise APIError("request body must be a JSON object")
    refuse_lone_surrogates(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        # A union reports one error per member; the deepest one is the most specific.
        err = max(exc.errors(), key=lambda e: len(e["loc"]))
        param = _field_path(data, err["loc"], missing=err["type"] == "missing")
        where = f"{param}: " if param else ""
        raise APIError(f"{where}{err['msg']}", param=param) from None


_SURROGATE = re.compile("[\ud800-\udfff]")  # JSON decodes a valid pair to one code point


def refuse_lone_surrogates(data: dict[str, Any]) -> None:
    """A 400 naming the first field whose text holds a lone UTF-16 surrogate: legal JSON
    ("\\ud800"), but no text a tokenizer, template or UTF-8 encoder can take."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:  # depth-first without recursion: JSON may nest deeper than Python's stack
        path, node = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                raise APIError(f"{path} must be valid Unicode text; it holds a lone surrogate",
                               param=path)
            continue
        if isinstance(node, dict):
            if any(_SURROGATE.search(key) for key in node):
                raise APIError(f"{path or 'the request body'} has a key that is not valid "
                               "Unicode text (a lone surrogate)", param=path or None)
            children = [(f"{path}.{k}" if path else k, v) for k, v in node.items()]
        elif isinstance(node, list):
            children = [(f"{path}[{i}]", v) for i, v in enumerate(node)
                        if isinstance(v, (str, list, dict))]
        else:
            continue
        stack.extend(reversed(children))  # the first field comes off the stack first


def _field_path(data: Any, loc: tuple[Any, ...], missing: bool) -> str | None:
    """``messages[0].content`` from a pydantic loc, skipping the union tags it interleaves."""
    path, node = "", data
    for i, part in enumerate(loc):
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            path, node = f"{path}.{part}" if path else part, node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            path, node = f"{path}[{part}]", node[part]
        elif missing and i == len(loc) - 1:  # a required field that is absent
            path = f"{path}.{part}" if path else str(part)
        # anything else is a union member tag such as "list[str]": not part of the path
    return path or None


class CatchAllErrors:
    """ASGI middleware answering any exception that escapes a handler before its response
    started as OpenAI's 500 body. Starlette's own handler for Exception answers too, but then
    re-raises, and uvicorn drops a keep-alive connection on any exception it sees."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watch(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:
            if started:  # mid-response only closing the connection can tell the client
                raise
            logging.getLogger(__name__).exception("%s %s failed", scope["method"], scope["path"])
            body = APIError(str(exc) or type(exc).__name__, 500,
                            type="internal_server_error").json()
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
