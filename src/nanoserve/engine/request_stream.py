"""RequestStream: one request's outputs crossing from the engine thread to an asyncio task;
the engine thread only schedules the helpers below onto the consumer's event loop."""
from __future__ import annotations

import asyncio
from typing import Any
from collections.abc import Callable

from nanoserve.outputs import RequestOutput


class RequestStream:
    """The outputs of one request; they are cumulative, so a consumer that falls behind gets
    only the newest one (slow clients do not make the server serialise every step)."""

    def __init__(self, request_id: str, abort: Callable[[str], None]):
        self.request_id = request_id
        self.loop = asyncio.get_running_loop()  # the loop of the task that will consume it
        self.finished = False
        self._abort = abort
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        while isinstance(item, RequestOutput) and not item.finished and not self._queue.empty():
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def cancel(self) -> None:
        """Abort the request unless it already ended (the client left, or gave up)."""
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)

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
