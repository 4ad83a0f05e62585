"""AsyncLLMEngine: one thread owns an LLMEngine and steps it; asyncio callers stream outputs.

A step must never block the event loop and the LLMEngine is not thread-safe, so one thread
touches it: callers send commands (add / abort / stop) on a thread-safe queue drained between
steps, and get outputs back on per-request asyncio queues.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

from nanoserve.engine.request import sample_request_ids
from nanoserve.engine.request_stream import RequestStream, call_in_loop, deliver, resolve_future
from nanoserve.outputs import RequestOutput
from nanoserve.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from nanoserve.config import EngineConfig
    from nanoserve.engine.llm_engine import EngineStats, LLMEngine
    from nanoserve.pooling import Pooler

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine is stopped or shutting down: it takes no new requests."""


class RequestFailedError(RuntimeError):
    """A request ended by a failure inside the engine rather than by its own input."""


Prompt = str | list[int]


@dataclass
class _Add:
    requests: list[tuple[str, Prompt, SamplingParams]]
    streams: list[RequestStream]  # one per sample of each request, in order
    arrival_time: float | None
    accepted: asyncio.Future[None]


@dataclass
class _Abort:
    request_ids: list[str] | None  # None: every request in flight


_STOP = object()
IDLE_CHECK_S = 0.5  # how often an idle engine checks that its executor still runs


class AsyncLLMEngine:
    """Serves many concurrent asyncio requests from one LLMEngine running in its own thread."""

    def __init__(self, make_engine: Callable[[], LLMEngine]):
        self._make_engine = make_engine
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="nanoserve-engine", daemon=True)
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._accepting = True
        # Held while an add is checked and queued, and while the loop's end stops admissions
        # and answers what is queued: no add can slip in between and wait forever.
        self._admission = threading.Lock()
        self._live: dict[str, RequestStream] = {}  # touched by the engine thread only
        self._listeners: list[Callable[[RequestOutput], None]] = []
        self._engine: LLMEngine | None = None  # stepped by its own thread only
        self.stats: EngineStats | None = None  # snapshot after the latest step
        self.crashed = False  # the loop died of an error (a broken executor), not a shutdown

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLMEngine:
        from nanoserve.engine.llm_engine import LLMEngine

        return cls(lambda: LLMEngine.from_config(config))

    def start(self) -> None:
        """Build the engine inside its thread (so one thread owns every device resource)."""
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    @property
    def config(self) -> EngineConfig:
        return self._require_engine().config

    @property
    def tokenizer(self) -> Any:
        return self._require_engine().tokenizer

    @property
    def vocab_size(self) -> int:
        return self._require_engine().model_config.vocab_size

    @property
    def max_model_len(self) -> int:
        return self._require_engine().max_model_len

    @property
    def eos_token_ids(self) -> list[int]:
        return self._require_engine().model_config.eos_token_ids

    @property
    def pooler(self) -> Pooler | None:
        """An embedding model's pooler; None for a generating one."""
        return self._require_engine().pooler

    @property
    def model_name(self) -> str:
        return self._require_engine().model_name

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._accepting

    def add_output_listener(self, listener: Callable[[RequestOutput], None]) -> None:
        """Call ``listener`` on the engine thread with every output (metrics use this)."""
        self._listeners.append(listener)

    async def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                          arrival_time: float | None = None,
                          timeout: float | None = None) -> RequestStream:
        """Queue a request of one sample (``params.n`` == 1); see ``add_requests``."""
        if params.n != 1:
            raise ValueError(f"n must be 1 here (add_requests takes more), got {params.n}")
        return (await self.add_requests([(request_id, prompt, params)], arrival_time,
                                        timeout))[0]

    async def add_requests(self, requests: list[tuple[str, Prompt, SamplingParams]],
                           arrival_time: float | None = None,
                           timeout: float | None = None) -> list[RequestStream]:
        """Queue (request id, prompt, params) requests in one command, all or none; returns
        the streams of each one's ``params.n`` samples in order once the engine took them.
        Raises ValueError for input the engine refuses, EngineOverloadedError when too many
        wait, EngineDeadError when the engine no longer takes requests. ``timeout``: seconds
        from now to abort them in (their streams then raise RequestTimeoutError)."""
        streams = [RequestStream(sample_id, self.abort, timeout) for rid, _, params in requests
                   for sample_id in sample_request_ids(rid, params.n)]
        accepted = asyncio.get_running_loop().create_future()
        with self._admission:
            if not self.is_running:
                raise EngineDeadError("the engine is shutting down")
            self._commands.put(_Add(requests, streams, arrival_time, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            for stream in streams:  # queued after the add: the engine drops what it took
                stream.cancel()
            raise
        except BaseException:
            for stream in streams:  # refused: nothing to abort (an id may be another's)
                stream.close()
            raise
        return streams

    async def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile (or find cached) the grammar of ``spec`` on the compiler's threads; raises
        ValueError when it does not compile."""
        compiler = self._require_engine().structured_outputs().compiler
        await asyncio.wrap_future(compiler.submit(spec))

    def abort(self, request_id: str) -> None:
        """Abort one request; thread-safe and a no-op for unknown or finished requests."""
        self._commands.put(_Abort([request_id]))

    def stop_admitting(self) -> None:
        """Refuse new requests (EngineDeadError) and let those in flight finish: a drain."""
        self._accepting = False

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every request in flight to end; True if they
        did. Polls: it is for a drain, once per process."""
        deadline = time.monotonic() + timeout
        while (self._live or not self._commands.empty()) and self._thread.is_alive():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def wait_stopped(self) -> None:
        """Block until the engine thread has ended (shut down, or crashed)."""
        self._thread.join()

    def begin_shutdown(self) -> None:
        """Refuse new requests and abort those in flight so their streams end now; safe in a
        signal handler (it sets a flag and calls the reentrant SimpleQueue.put)."""
        self._accepting = False
        self._commands.put(_Abort(None))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread (ending any stream still open) and release the engine."""
        self._accepting = False
        if self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join(timeout)

    def _require_engine(self) -> LLMEngine:
        if self._engine is None:
            raise EngineDeadError("the engine is not started")
        return self._engine

    def _run(self) -> None:
        try:
            self._engine = self._make_engine()
            self.stats = self._engine.stats()
        except BaseException as exc:  # reported to start()'s caller
            self._startup_error = exc
            return
        finally:
            self._ready.set()
        try:
            self._serve(self._engine)
        except BaseException:
            self.crashed = True
            logger.exception("the engine loop crashed")
        finally:
            with self._admission:
                self._accepting = False
                self._refuse_pending()
            self._fail_live(EngineDeadError("the engine stopped"))
            try:
                self._engine.close()
            except Exception:
                logger.exception("closing the engine failed")

    def _serve(self, engine: LLMEngine) -> None:
        while True:
            # Block while idle (waking to check the executor: a worker may die meanwhile);
            # between steps, take whatever has arrived without waiting.
            commands = []
            if not engine.has_unfinished_requests():
                try:
                    commands.append(self._commands.get(timeout=IDLE_CHECK_S))
                except queue.Empty:
                    if not engine.executor_alive:
                        raise EngineDeadError("the executor stopped") from None
                    continue
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            stop = self._apply(engine, commands)
            if engine.has_unfinished_requests():
                self._step(engine)
            if stop:
                return

    def _apply(self, engine: LLMEngine, commands: list[Any]) -> bool:
        stop = False
        for cmd in commands:
            try:
                if isinstance(cmd, _Add):
                    self._add(engine, cmd)
                elif isinstance(cmd, _Abort):
                    engine.abort_request(list(self._live) if cmd.request_ids is None
                                         else cmd.request_ids)
                elif cmd is _STOP:
                    engine.abort_request(list(self._live))  # the last step reports them
                    stop = True
            except Exception:  # a bug handling one command must not stop the engine loop
                logger.exception("engine command %r failed", cmd)
        return stop

    def _add(self, engine: LLMEngine, cmd: _Add) -> None:
        error: BaseException | None = None
        added: list[str] = []
        if not self._accepting:
            error = EngineDeadError("the engine is shutting down")
        else:
            try:
                for request_id, prompt, params in cmd.requests:
                    engine.add_request(request_id, prompt, params, cmd.arrival_time)
                    added += sample_request_ids(request_id, params.n)
                self._live.update((stream.request_id, stream) for stream in cmd.streams)
            except Exception as exc:  # bad input (ValueError) or a bug: only these requests fail
                error = exc
                engine.abort_request(added)  # all or none
        answered = call_in_loop(cmd.accepted.get_loop(), resolve_future, cmd.accepted, error)
        if not answered and error is None:  # the caller's loop is gone: nobody wants them
            for rid in added:
                self._live.pop(rid)
            engine.abort_request(added)

    def _step(self, engine: LLMEngine) -> None:
        try:
            outputs = engine.step()
        except Exception as exc:
            # The culprit in the batch is unknown: fail all of them. Keep serving new requests
            # unless the executor stopped for good (a broken tensor-parallel group).
            logger.exception("engine step failed; failing the requests in flight")
            failed = list(self._live)
            self._fail_live(RequestFailedError(f"the engine failed: {exc!r}"))
            if not engine.executor_alive:
                raise
            try:
                engine.abort_request(failed)
            except Exception:
                logger.exception("aborting the failed requests failed")
            return
        finally:
            self.stats = engine.stats()
        self._dispatch(engine, outputs)

    def _dispatch(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        for out in outputs:
            for listener in self._listeners:
                try:
                    listener(out)
                except Exception:
                    logger.exception("output listener failed")
            stream = self._live.get(out.request_id)
            if stream is None:
                continue  # aborted by its consumer, which no longer listens
            item: RequestOutput | BaseException = out
            if out.finished:
                del self._live[out.request_id]
                if out.outputs[0].finish_reason == "error":  # its own failure, logged already
                    item = RequestFailedError(f"the request failed: {out.outputs[0].stop_reason}")
            batches.setdefault(stream.loop, []).append((stream, item))
        # One wake-up per event loop per step, not one per request.
        for loop, items in batches.items():
            if not call_in_loop(loop, deliver, items):  # its requests have no consumer
                ids = [stream.request_id for stream, _ in items]
                for rid in ids:
                    self._live.pop(rid, None)
                engine.abort_request(ids)

    def _fail_live(self, error: BaseException) -> None:
        streams, self._live = list(self._live.values()), {}
        for stream in streams:
            call_in_loop(stream.loop, stream.put, error)

    def _refuse_pending(self) -> None:
        """Answer adds that raced with the stop, so their callers do not wait forever."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                call_in_loop(cmd.accepted.get_loop(), resolve_future, cmd.accepted,
                             EngineDeadError("the engine stopped"))
