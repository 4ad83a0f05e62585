"""Start-up a person can watch: nanoserve's INFO lines on stderr, and each phase's time."""
from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator

logger = logging.getLogger("nanoserve")


def configure_logging() -> None:
    """Show nanoserve's INFO lines on stderr (as vLLM does), unless the application set up
    logging itself or ``NANOSERVE_CONFIGURE_LOGGING=0``; ``NANOSERVE_LOGGING_LEVEL`` sets
    the level."""
    if (os.environ.get("NANOSERVE_CONFIGURE_LOGGING", "1") == "0" or logger.handlers
            or logging.getLogger().handlers):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s",
                                           "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("NANOSERVE_LOGGING_LEVEL", "INFO").upper())


@contextlib.contextmanager
def phase(what: str, log: logging.Logger = logger) -> Iterator[None]:
    """Log how long the block took: ``<what> in 1.23 s``."""
    start = time.perf_counter()
    yield
    log.info("%s in %.2f s", what, time.perf_counter() - start)
