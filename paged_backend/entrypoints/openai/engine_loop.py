"""One background thread steps the engine; asyncio handlers add requests and await their outputs.

The engine is synchronous (``add_request`` / ``step`` / ``abort_request``). Every call to it happens under one
lock, from the handlers (``add``, ``abort``) or from the loop thread (step), and each step's outputs go to their
requests' asyncio queues on the server's event loop. If a step raises, the loop records the error, fails every
waiting request and stops: ``/health`` then answers 503.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from paged_backend.outputs import RequestOutput
from paged_backend.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


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
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.error: BaseException | None = None
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="paged-backend-engine", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.error is None and self.thread.is_alive()

    def add(self, request_id: str, prompt: dict[str, Any], params: SamplingParams) -> asyncio.Queue:
        """Queue a request now; raises the engine's ValueError for a bad one, QueueFullError, EngineDeadError."""
        if not self.alive:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        queue: asyncio.Queue = asyncio.Queue()
        with self.lock:
            waiting = len(self.engine.scheduler.waiting)
            if self.max_waiting_requests and waiting >= self.max_waiting_requests:
                raise QueueFullError(f"{waiting} requests are waiting (max_waiting_requests)")
            self.engine.add_request(request_id, prompt, params)
            self.queues[request_id] = (asyncio.get_running_loop(), queue)
        self.wake.set()
        return queue

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
        """Drop the request and free its blocks now (a client went away)."""
        with self.lock:
            self.queues.pop(request_id, None)
            self.engine.abort_request(request_id)
            if self.on_abort is not None:
                self.on_abort(request_id)

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return self.engine.stats()

    def shutdown(self) -> None:
        self.stopped = True
        self.wake.set()
        self.thread.join(timeout=10)

    def _run(self) -> None:
        while not self.stopped:
            self.wake.wait()
            try:
                with self.lock:
                    outputs = self.engine.step() if self.engine.has_unfinished_requests() else None
                    if outputs is None:
                        self.wake.clear()
                        continue
                    for out in outputs:
                        if self.on_output is not None:
                            self.on_output(out)
                        target = self.queues.get(out.request_id)
                        if target is not None:
                            loop, queue = target
                            loop.call_soon_threadsafe(queue.put_nowait, out)
                            if out.finished:
                                del self.queues[out.request_id]
            except BaseException as exc:  # noqa: BLE001 - reported to every waiting request and /health
                logger.exception("engine step failed; the engine loop stops")
                self.error = exc
                with self.lock:
                    for loop, queue in self.queues.values():
                        loop.call_soon_threadsafe(queue.put_nowait, exc)
                    self.queues.clear()
                return
