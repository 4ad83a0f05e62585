"""The OpenAI-compatible HTTP server: the FastAPI app (the `serve` command: serve_command.py).

Only the standard library is imported at the top: the `serve` command imports this module
when the CLI starts, and `generate` / `chat` must keep working where fastapi, uvicorn or
prometheus_client are not installed.
"""
# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations at runtime,
# and `Request` is imported inside build_app, out of reach of string annotations.
import secrets
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI

    from nanoserve.engine.async_engine import AsyncLLMEngine

def nanoserve_version() -> str:
    try:
        return version("nanoserve")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


# Seconds a client refused for load (or a drain) is told to wait before it tries again.
RETRY_AFTER_S = 1
DEFAULT_MAX_BODY_BYTES = 16 << 20


def build_app(engine: "AsyncLLMEngine", served_model_name: str | None = None,
              api_key: str | None = None, reasoning_parser: str | None = None,
              request_timeout: float | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              allowed_origins: list[str] | None = None, ui: bool = True) -> "FastAPI":
    """The FastAPI app serving ``engine`` (already started) under ``served_model_name``. With
    ``api_key`` set, all but /health, /version and /metrics (for probes and scrapers) need
    ``Authorization: Bearer KEY``. ``request_timeout``: seconds after which a request is
    aborted (504); ``max_body_bytes``: larger request bodies get a 413 (default 16 MiB);
    ``allowed_origins``: the browser origins CORS lets call the API (default: none);
    ``ui``: serve the chat page at ``/`` (it asks for the API key, if any)."""
    from fastapi import APIRouter, Depends, FastAPI, Request
    from fastapi.openapi.utils import get_openapi
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException

    from nanoserve.engine.async_engine import EngineDeadError, RequestFailedError
    from nanoserve.engine.llm_engine import EngineOverloadedError
    from nanoserve.engine.metrics import ServerMetrics
    from nanoserve.engine.request_stream import RequestTimeoutError
    from nanoserve.entrypoints.body_limit import BodyLimit
    from nanoserve.entrypoints.errors import APIError, CatchAllErrors, parse_json
    from nanoserve.entrypoints.openai_handlers import OpenAIServing
    from nanoserve.entrypoints.protocol import (ChatCompletionRequest, CompletionRequest,
                                                DetokenizeRequest, TokenizeRequest)
    from nanoserve.entrypoints.bodies import ModelCard, ModelList
    from nanoserve.entrypoints.embeddings import EmbeddingRequest, create_embeddings
    from nanoserve.entrypoints.responses_api import ResponsesServing
    from nanoserve.entrypoints.responses_protocol import ResponsesRequest

    name = served_model_name or engine.model_name
    serving = OpenAIServing(engine, name, reasoning_parser, request_timeout)
    responses = ResponsesServing(serving)
    metrics = ServerMetrics(name, lambda: engine.stats)
    engine.add_output_listener(metrics.observe)

    async def require_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(),
                                                                    api_key.encode()):
            raise APIError("invalid or missing API key", status=401,
                           type="authentication_error", code="invalid_api_key")

    app = FastAPI(title="nanoserve", version=nanoserve_version())
    app.add_middleware(CatchAllErrors)  # any other exception: a 500 in OpenAI's shape
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"])
    api = APIRouter(dependencies=[Depends(require_key)])

    def answer(error: APIError, headers: dict[str, str] | None = None) -> Response:
        return Response(error.json(), status_code=error.status, media_type="application/json",
                        headers=headers)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> Response:
        return answer(exc)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return answer(APIError(str(exc.detail), exc.status_code, type=kind))

    @app.exception_handler(EngineDeadError)  # stopped or draining
    @app.exception_handler(EngineOverloadedError)  # the waiting queue is full
    async def engine_unavailable(_: Request, exc: Exception) -> Response:
        return answer(APIError(str(exc), 503, type="service_unavailable"),
                      {"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(RequestTimeoutError)
    async def timed_out(_: Request, exc: RequestTimeoutError) -> Response:
        return answer(APIError(str(exc), 504, type="timeout_error"))

    # The engine thread logged its cause; CatchAllErrors logs any other error's traceback.
    @app.exception_handler(RequestFailedError)
    async def request_failed(_: Request, exc: RequestFailedError) -> Response:
        return answer(APIError(str(exc), 500, type="internal_server_error"))

    @app.get("/health")
    async def health() -> Response:
        up = engine.is_running
        return JSONResponse({"status": "ok" if up else "unavailable"},
                            status_code=200 if up else 503)

    @app.get("/version")
    async def get_version() -> dict[str, str]:
        return {"version": nanoserve_version()}

    @app.get("/metrics")
    async def get_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    if ui:
        from nanoserve.entrypoints.ui import add_chat_page

        add_chat_page(app)

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = ModelCard(id=name, root=engine.model_name, max_model_len=engine.max_model_len)
        return ModelList(data=[card]).model_dump()

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.completions(parse_json(await request.body()), request)

    @api.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await serving.chat(parse_json(await request.body()), request)

    @api.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await responses.create(parse_json(await request.body()), request)

    @api.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        return responses.retrieve(response_id)

    @api.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await create_embeddings(serving, parse_json(await request.body()), request)

    @api.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        return await serving.tokenize(parse_json(await request.body()))

    @api.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        return serving.detokenize(parse_json(await request.body()))

    app.include_router(api)
    bodies = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
              "/v1/responses": ResponsesRequest, "/v1/embeddings": EmbeddingRequest,
              "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _declare_request_bodies(schema, bodies)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _declare_request_bodies(schema: dict[str, Any], bodies: dict[str, Any]) -> None:
    """Declare each POST route's pydantic model as its body in the OpenAPI ``schema`` (for
    /docs): the handlers parse the raw body themselves, to answer bad input with OpenAI's
    400 naming the field, so FastAPI cannot see what they take."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in bodies.items():
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        ref = {"$ref": f"#/components/schemas/{model.__name__}"}
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": ref}}}
