"""`nanoserve serve`: its flags, the served model's name, start-up, the ready line, shutdown.

Only the standard library is imported at the top: the CLI imports this module to register
`serve`, and `generate` / `chat` must keep working where fastapi, uvicorn or prometheus_client
are not installed.
"""
from __future__ import annotations

import argparse
import logging
import os
import time

from nanoserve.entrypoints.server import DEFAULT_MAX_BODY_BYTES, build_app

logger = logging.getLogger(__name__)


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
