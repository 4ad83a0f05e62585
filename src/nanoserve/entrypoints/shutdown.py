"""How `nanoserve serve` ends: a drain on SIGTERM/SIGINT, an exit when the engine dies."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import uvicorn

from nanoserve.engine.async_engine import AsyncLLMEngine

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """A uvicorn server that ends on the engine's terms.

    The first SIGINT/SIGTERM drains: the engine stops admitting (new requests and /health get
    503, the listener stays open so a balancer sees it), the requests in flight get ``drain_s``
    seconds to finish, the rest are aborted, and the server exits. A second signal aborts them
    at once, a third stops waiting for connections. (uvicorn alone would wait for every open
    stream, then re-raise the signal, killing the process before the engine is closed.)

    When the engine dies (a tensor-parallel worker died), its requests have been failed: the
    server exits, and ``engine_died`` tells the caller to exit non-zero so that a supervisor
    restarts it.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, drain_s: float,
                 on_ready: Callable[[str], None] | None = None):
        super().__init__(config)
        self.engine, self.drain_s = engine, drain_s
        self.on_ready = on_ready  # called with the base URL once the socket listens
        self.draining = False
        self.engine_died = False
        threading.Thread(target=self._watch_engine, name="nanoserve-engine-watch",
                         daemon=True).start()

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started and self.on_ready is not None and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            host = f"[{host}]" if ":" in host else host
            self.on_ready(f"http://{host}:{port}")

    def handle_exit(self, sig: int, frame: Any) -> None:
        # Runs in the main thread between bytecodes: flags, a queue put and a thread start.
        if not self.draining and self.drain_s > 0:
            self.draining = True
            self.engine.stop_admitting()
            threading.Thread(target=self._drain, name="nanoserve-drain", daemon=True).start()
            return
        self.engine.begin_shutdown()
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True

    def _drain(self) -> None:
        if not self.engine.wait_idle(self.drain_s):
            logger.warning("requests still running after a drain of %g s: aborting them",
                           self.drain_s)
        self.engine.begin_shutdown()
        self.should_exit = True

    def _watch_engine(self) -> None:
        self.engine.wait_stopped()
        if self.engine.crashed:
            logger.error("the engine died; stopping the server")
            self.engine_died = True
            self.should_exit = True
