"""The OpenAI-compatible HTTP server: the FastAPI app, the `serve` command, clean shutdown.

Only the standard library is imported at the top: the CLI imports this module to register
`serve`, and `generate` / `chat` must keep working where fastapi, uvicorn or prometheus_client
are not installed.
"""
# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations at runtime,
# and `Request` is imported inside build_app, out of reach of string annotations.
import argparse
import logging
import os
import secrets
import time
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


logger = logging.getLogger(__name__)

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


def add_serve_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Register `nanoserve serve [MODEL] ...` with the shared engine flags."""
    from nanoserve.entrypoints.cli import add_engine_args
    from nanoserve.entrypoints.reasoning import REASONING_PARSERS

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API over HTTP")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="local HF folder or .gguf file (same as --model)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    serve.add_argument("--api-key", default=os.environ.get("NANOSERVE_API_KEY"),
                       help="require this bearer token on the API (default: $NANOSERVE_API_KEY)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model name clients use (default: MODEL as given; "
                            "SmolLM2-135M-Instruct for the packaged model)")
    serve.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                       help="split chat answers' <think> blocks into reasoning_content")
    serve.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                       help="browser origins allowed to call the API (CORS), e.g. "
                            "http://localhost:3000 or '*' (default: none)")
    serve.add_argument("--no-ui", dest="ui", action="store_false",
                       help="do not serve the chat page at /")
    serve.add_argument("--log-level", default="info", help="(default: %(default)s)",
                       choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--request-timeout", type=float, default=None, metavar="S",
                       help="abort a request S seconds after it arrived (504 / an error event)")
    serve.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                       help="answer larger request bodies with 413 (default: 16 MiB)")
    serve.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="S",
                       help="on SIGTERM/SIGINT stop admitting (503) and give the requests in "
                            "flight S seconds to finish before aborting them (default: 10); "
                            "a second signal aborts them at once")
    add_engine_args(serve)
    serve.set_defaults(func=run_server)


def served_name(model: str | None) -> str:
    """The name clients use by default: the model as the user gave it (vLLM's rule), or the
    packaged default model's short name."""
    if model is not None:
        return str(model)
    from nanoserve.models.gguf import DEFAULT_MODEL_FILE

    return DEFAULT_MODEL_FILE.split(".")[0]


def run_server(args: argparse.Namespace) -> int:
    """Load the engine and serve until a signal (then drain, exit 0) or the engine's death
    (exit 1, so that a supervisor restarts the server)."""
    import uvicorn

    from nanoserve.engine.async_engine import AsyncLLMEngine
    from nanoserve.entrypoints.cli import engine_config_from_args
    from nanoserve.entrypoints.shutdown import DrainingServer

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"MODEL ({args.model_tag}) and --model ({args.model}) disagree")
        args.model = args.model_tag
    start = time.perf_counter()
    config = engine_config_from_args(args)  # bad flags fail before the model loads
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = AsyncLLMEngine.from_config(config)
    engine.start()
    try:
        name = args.served_model_name or served_name(args.model)
        logger.info("serving %s as %r: max_model_len %d", engine.model_name, name,
                    engine.max_model_len)
        app = build_app(engine, name, args.api_key, args.reasoning_parser,
                        args.request_timeout, args.max_request_body_bytes, args.allowed_origins,
                        args.ui)
        uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=10)

        def ready(url: str) -> None:
            page = f"chat page {url}/, " if args.ui else ""
            print(f"nanoserve: serving {name!r}: {page}OpenAI API {url}/v1 (started in "
                  f"{time.perf_counter() - start:.1f} s)", flush=True)

        server = DrainingServer(uv_config, engine, args.shutdown_timeout, ready)
        server.run()
    finally:
        engine.shutdown()
    return 1 if server.engine_died else 0
