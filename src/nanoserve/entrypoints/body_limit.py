"""A cap on request bodies: 413 before the body is read when its declared length is over it,
as soon as it is passed when it comes chunked."""
from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nanoserve.entrypoints.errors import APIError


def too_large(limit: int) -> APIError:
    return APIError(f"the request body is larger than the server's limit of {limit} bytes "
                    "(--max-request-body-bytes)", status=413, code="request_too_large")


class BodyLimit:
    """ASGI middleware refusing HTTP request bodies over ``max_bytes``."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")  # digits: h11 checked
        if declared is not None and int(declared) > self.max_bytes:
            # Answered at once: the body is never read (uvicorn then drops the connection).
            body = json.dumps(too_large(self.max_bytes).body()).encode()
            await send({"type": "http.response.start", "status": 413,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return None
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:  # a chunked body past the cap: the endpoint answers 413
                raise too_large(self.max_bytes)
            return message

        return await self.app(scope, counted, send)
