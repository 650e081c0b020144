"""One background thread owns the engine; asyncio handlers hand it work and await the results.

The engine is synchronous (``add_request`` / ``step`` / ``abort_request``) and only the loop thread touches it:
handlers queue calls (``add``, ``abort``, ``stats``) that the thread runs between steps, and await their results
as futures, so the event loop never blocks on a step in progress (a lock shared with the stepping thread would
stall every stream for as long as the engine stays busy). Each step's outputs go to their requests' asyncio
queues on the server's event loop. If a step raises, the loop records the error, fails every waiting request and
stops: ``/health`` then answers 503.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from paged_backend.outputs import RequestOutput
from paged_backend.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Call = tuple[Callable[[Any], Any], asyncio.AbstractEventLoop | None, asyncio.Future | None]


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an error; nothing more can run."""


class QueueFullError(RuntimeError):
    """More requests wait than ``max_waiting_requests`` allows."""


class EngineLoop:
    def __init__(
        self,
        engine: Any,
        max_waiting_requests: int | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
        on_abort: Callable[[str], None] | None = None,
    ) -> None:
        self.engine = engine
        self.on_output = on_output  # sees every delivered output, on the loop thread (metrics)
        self.on_abort = on_abort
        self.max_waiting_requests = max_waiting_requests
        self.num_waiting = 0  # the scheduler's queue length after the last step or call, for a check without it
        self.calls: queue.SimpleQueue[Call] = queue.SimpleQueue()
        self.wake = threading.Event()
        self.queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # loop thread only
        self.error: BaseException | None = None
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="paged-backend-engine", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.error is None and self.thread.is_alive()

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(engine)`` on the loop thread between two steps; its result or exception comes back here."""
        if not self.alive:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.calls.put((fn, loop, future))
        self.wake.set()
        return await future

    async def add(self, requests: list[tuple[str, dict[str, Any]]], params: SamplingParams) -> list[asyncio.Queue]:
        """Queue requests in one go, all or none: raises the engine's ValueError for a bad one, QueueFullError,
        EngineDeadError. A handler cancelled meanwhile (its client left) leaves nothing behind."""
        self._check_room(self.num_waiting)  # answers at once, even while a long step runs
        loop = asyncio.get_running_loop()
        queues: list[asyncio.Queue] = [asyncio.Queue() for _ in requests]

        def add_all(engine: Any) -> None:
            self._check_room(len(engine.scheduler.waiting))
            try:
                for (request_id, prompt), q in zip(requests, queues):
                    engine.add_request(request_id, prompt, params)
                    self.queues[request_id] = (loop, q)
            except BaseException:
                for request_id, _ in requests:
                    self._abort_now(request_id)
                raise

        try:
            await self.call(add_all)
        except asyncio.CancelledError:
            for request_id, _ in requests:
                self.abort(request_id)
            raise
        return queues

    async def stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Yield an added request's cumulative outputs as the engine produces them; leaving early aborts it."""
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine stopped: {item!r}") from item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Drop the request and free its blocks before the next step (a client went away); returns at once."""
        self.calls.put((lambda _: self._abort_now(request_id), None, None))
        self.wake.set()

    async def stats(self) -> dict[str, Any]:
        if not self.alive:  # the thread is gone: reading the engine directly is safe
            return self.engine.stats()
        return await self.call(lambda engine: engine.stats())

    def shutdown(self) -> None:
        self.stopped = True
        self.wake.set()
        self.thread.join(timeout=10)

    def _check_room(self, waiting: int) -> None:
        if self.max_waiting_requests and waiting >= self.max_waiting_requests:
            raise QueueFullError(f"{waiting} requests are waiting (max_waiting_requests)")

    # ------------------------------------------------------------------ loop thread
    def _abort_now(self, request_id: str) -> None:
        self.queues.pop(request_id, None)
        self.engine.abort_request(request_id)  # an unknown or finished id is ignored
        if self.on_abort is not None:
            self.on_abort(request_id)

    def _run_calls(self) -> None:
        while True:
            try:
                fn, loop, future = self.calls.get_nowait()
            except queue.Empty:
                self.num_waiting = len(self.engine.scheduler.waiting)
                return
            try:
                result, error = fn(self.engine), None
            except Exception as exc:  # noqa: BLE001 - goes back to the caller
                result, error = None, exc
            if future is not None and loop is not None:
                loop.call_soon_threadsafe(_settle, future, result, error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if self.on_output is not None:
                self.on_output(out)
            target = self.queues.get(out.request_id)
            if target is not None:
                loop, q = target
                loop.call_soon_threadsafe(q.put_nowait, out)
                if out.finished:
                    del self.queues[out.request_id]

    def _run(self) -> None:
        while not self.stopped:
            self.wake.wait()
            self.wake.clear()  # before running the calls: one queued after this sets it again
            try:
                self._run_calls()
                while self.engine.has_unfinished_requests() and not self.stopped:
                    self._deliver(self.engine.step())
                    self._run_calls()
            except BaseException as exc:  # noqa: BLE001 - reported to every waiting request and /health
                logger.exception("engine step failed; the engine loop stops")
                self.error = exc
                for loop, q in self.queues.values():
                    loop.call_soon_threadsafe(q.put_nowait, exc)
                self.queues.clear()
                self._fail_calls(exc)
                return
        self._fail_calls(EngineDeadError("the server is shutting down"))

    def _fail_calls(self, exc: BaseException) -> None:
        """Calls queued after the last run get the loop's error instead of waiting forever."""
        while True:
            try:
                _, loop, future = self.calls.get_nowait()
            except queue.Empty:
                return
            if future is not None and loop is not None:
                loop.call_soon_threadsafe(_settle, future, None, EngineDeadError(f"the engine stopped: {exc!r}"))


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
