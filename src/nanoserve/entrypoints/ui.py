"""The chat page at ``/``: plain HTML, CSS and JavaScript shipped in ``nanoserve/ui``, served
as they are (no build step, nothing fetched from elsewhere) under a strict CSP."""
from __future__ import annotations

from importlib.resources import files
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI

ASSETS = {"app.js": "text/javascript", "markdown.js": "text/javascript",
          "style.css": "text/css"}
# Only the page's own files run or style it: an injected inline script would not execute.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def add_chat_page(app: FastAPI) -> None:
    """GET / (the page) and GET /ui/<asset>; neither needs the API key, the page asks for it."""
    from fastapi.responses import Response

    from nanoserve.entrypoints.errors import APIError

    ui = files("nanoserve") / "ui"
    headers = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
               "Cache-Control": "no-cache"}

    @app.get("/", include_in_schema=False)
    async def chat_page() -> Response:
        return Response((ui / "index.html").read_bytes(), media_type="text/html",
                        headers=headers)

    @app.get("/ui/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in ASSETS:
            raise APIError(f"no such file: /ui/{name}", status=404, type="not_found_error")
        return Response((ui / name).read_bytes(), media_type=ASSETS[name], headers=headers)
