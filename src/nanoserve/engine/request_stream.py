"""RequestStream: one request's outputs crossing from the engine thread to an asyncio task;
the engine thread only schedules the helpers below onto the consumer's event loop."""
from __future__ import annotations

import asyncio
from typing import Any
from collections.abc import Callable

from nanoserve.outputs import RequestOutput


class RequestTimeoutError(RuntimeError):
    """The request ran past its deadline and was aborted."""


class RequestStream:
    """The outputs of one request; they are cumulative, so a consumer that falls behind gets
    only the newest one (slow clients do not make the server serialise every step). With
    ``timeout`` (seconds), the request is aborted then and the stream raises
    RequestTimeoutError."""

    def __init__(self, request_id: str, abort: Callable[[str], None],
                 timeout: float | None = None):
        self.request_id = request_id
        self.loop = asyncio.get_running_loop()  # the loop of the task that will consume it
        self.finished = False
        self._abort = abort
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._timer = None if timeout is None else self.loop.call_later(
            max(timeout, 0.0), self._expire, timeout)

    def _expire(self, timeout: float) -> None:
        if not self.finished:  # the error goes behind what is queued; the consumer skips there
            self.put(RequestTimeoutError(
                f"the request ran past its deadline, {timeout:.2f} s after it was queued"))
            self._abort(self.request_id)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        while isinstance(item, RequestOutput) and not item.finished and not self._queue.empty():
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item.finished:
            self.close()
        return item

    def cancel(self) -> None:
        """Abort the request unless it already ended (the client left, or gave up)."""
        if not self.finished:
            self.close()
            self._abort(self.request_id)

    def close(self) -> None:
        """End the stream without aborting (the request ended, or was never taken)."""
        self.finished = True
        if self._timer is not None:
            self._timer.cancel()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Queue an output or an error; call on the stream's event loop thread only."""
        self._queue.put_nowait(item)


def call_in_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> bool:
    """Run ``fn`` on ``loop``'s thread; False if that loop is closed (its caller is gone)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:
        return False


def resolve_future(future: asyncio.Future[None], error: BaseException | None) -> None:
    """Settle ``future`` with success or ``error``, unless its waiter already gave up."""
    if future.done():  # the caller was cancelled meanwhile
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def deliver(items: list[tuple[RequestStream, Any]]) -> None:
    """Hand one engine step's outputs to their streams (runs on their event loop)."""
    for stream, item in items:
        stream.put(item)
