"""One background thread owns the engine; asyncio handlers and plain threads hand it work and wait for results.

The engine is synchronous (``add_request`` / ``step`` / ``abort_request``) and only the loop thread touches it:
callers queue calls (``add``, ``abort``, ``stats``) that the thread runs between steps. Async callers await them
as futures, so an event loop never blocks on a step in progress (a lock shared with the stepping thread would
stall every stream for as long as the engine stays busy); threads wait on their own futures. Each step's outputs
go to their requests' queues: an asyncio queue on the caller's event loop, or a thread-safe queue. Requests from
every caller share each step (continuous batching across callers). A request added with ``stream=False`` only
receives its final output, and when no request streams the engine skips building per-step outputs.

When steps fail, the engine fails the requests it holds responsible (``StepError``, see
``step_failures.step_failed``): each gets a ``RequestFailedError`` naming the cause, and the loop steps on with the
rest. Only an error the engine cannot recover from (the device's own, the scheduler's), or a shutdown, stops the
loop: then every waiting request and call gets an ``EngineDeadError`` (the server's ``/health`` then answers 503).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paged_backend.engine import handoff
from paged_backend.engine.llm_engine import StepError
from paged_backend.outputs import RequestOutput
from paged_backend.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from paged_backend.engine.llm_engine import LLMEngine
    from paged_backend.structured_output.grammar_budget import GrammarService

logger = logging.getLogger(__name__)

Settle = Callable[[Any, BaseException | None], None]  # called on the loop thread with (result, error)
Delivery = RequestOutput | BaseException  # what a request's queue receives: an output, or why the loop stopped


@dataclass(frozen=True)
class Sink:
    """Where a request's outputs go: ``put`` hands one over (raises RuntimeError once an event loop closed)."""

    put: Callable[[Delivery], None]
    every_step: bool  # False: the final output only


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an error or a shutdown; nothing more can run."""


class RequestFailedError(RuntimeError):
    """The step that ran this request failed; the request was aborted, the engine goes on with the others."""


class QueueFullError(RuntimeError):
    """More requests wait than ``max_waiting_requests`` allows."""


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        max_waiting_requests: int | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
        on_abort: Callable[[str], None] | None = None,
    ) -> None:
        self.engine = engine
        self.on_output = on_output  # sees every delivered output, on the loop thread (metrics)
        self.on_abort = on_abort
        self.max_waiting_requests = max_waiting_requests
        self.num_waiting = 0  # the scheduler's queue length after the last step or call, for a check without it
        self.calls: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], Settle | None]] = queue.SimpleQueue()
        self.submit_lock = threading.Lock()  # a call is queued before the loop closes, or refused
        self.closed = False
        self.wake = threading.Event()
        self.sinks: dict[str, Sink] = {}  # loop thread only
        self.error: BaseException | None = None
        self.stopped = False
        self.grammars: GrammarService | None = None  # a server's: see ``structured_output/grammar_budget.py``
        # adds queued (under submit_lock) and run (on the loop thread): while some wait, async scheduling queues no
        # step ahead of them, so they wait for the step in flight only (``LLMEngine.arrivals``)
        self.adds_queued = self.adds_run = 0
        engine.arrivals = self._adds_waiting
        self.thread = threading.Thread(target=self._run, name="paged-backend-engine", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.error is None and not self.closed and self.thread.is_alive()

    # ------------------------------------------------------------------ calls
    def _submit(self, fn: Callable[[LLMEngine], Any], settle: Settle | None) -> None:
        with self.submit_lock:
            if self.closed or self.error is not None:
                raise EngineDeadError(f"the engine stopped: {self.error!r}")
            self.calls.put((fn, settle))
        self.wake.set()

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """``fn(engine)`` on the loop thread between two steps; its result or exception comes back here."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._submit(fn, lambda result, error: handoff.post(loop, handoff.settle, future, result, error))
        return await future

    def call_sync(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """``call`` for a plain thread: blocks this thread (never the loop thread) until ``fn`` has run."""
        if threading.current_thread() is self.thread:
            return fn(self.engine)
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._submit(fn, lambda result, error: handoff.settle(future, result, error))
        return future.result()

    # ------------------------------------------------------------------ requests
    def _adder(
        self,
        requests: list[tuple[str, Any]],
        params: SamplingParams | list[SamplingParams],
        sinks: list[Sink],
        add_kwargs: dict[str, Any],
    ) -> Callable[[LLMEngine], None]:
        with self.submit_lock:  # the call is queued next (or the loop is dead, and nothing steps any more)
            self.adds_queued += 1
        per_request = params if isinstance(params, list) else [params] * len(requests)
        # A keyword whose value is a list gives one value per request (``lora_request``); others apply to all.
        kwargs = [
            {key: value[i] if isinstance(value, list) else value for key, value in add_kwargs.items()}
            for i in range(len(requests))
        ]

        def add_all(engine: LLMEngine) -> None:
            self.adds_run += 1
            self._check_room(len(engine.scheduler.waiting), len(requests))
            added: list[str] = []
            try:
                for (request_id, prompt), p, sink, extra in zip(requests, per_request, sinks, kwargs):
                    engine.add_request(request_id, prompt, p, **extra)
                    added.append(request_id)
                    self.sinks[request_id] = sink
            except BaseException:
                for request_id in added:  # only these: an id that failed may be another caller's
                    self._abort_now(request_id)
                raise

        return add_all

    async def add(
        self,
        requests: list[tuple[str, Any]],
        params: SamplingParams | list[SamplingParams],
        stream: bool = True,
        **add_kwargs: Any,
    ) -> list[asyncio.Queue[Delivery]]:
        """Queue requests in one go, all or none: raises the engine's ValueError for a bad one, QueueFullError,
        EngineDeadError. A caller cancelled meanwhile (its client left) leaves nothing behind."""
        self._check_room(self.num_waiting, len(requests))  # answers at once, even while a long step runs
        grammars = _structured(params)
        if grammars and self.grammars is not None:
            await self.grammars.prepare(grammars)  # caps, then a compile process under a time budget
        elif grammars:
            await asyncio.to_thread(self.compile_grammars, params)
        loop = asyncio.get_running_loop()
        queues: list[asyncio.Queue[Delivery]] = [asyncio.Queue() for _ in requests]
        sinks = [Sink(functools.partial(handoff.post, loop, q.put_nowait), stream) for q in queues]
        try:
            await self.call(self._adder(requests, params, sinks, add_kwargs))
        except asyncio.CancelledError:
            for request_id, _ in requests:
                self.abort(request_id)
            raise
        return queues

    def compile_grammars(self, params: SamplingParams | list[SamplingParams]) -> None:
        """Compile the requests' output grammars on the calling thread, not on the one that steps every request:
        the engine's own compile, when it adds them, then finds them cached. A bad one raises its ValueError."""
        for grammar in _structured(params):
            self.engine.input_processor.grammar_compiler().compile(grammar)

    def add_sync(
        self,
        requests: list[tuple[str, Any]],
        params: SamplingParams | list[SamplingParams],
        stream: bool = True,
        **add_kwargs: Any,
    ) -> list[queue.SimpleQueue[Delivery]]:
        """``add`` for a plain thread; the outputs arrive in thread-safe queues. Interrupted while it waits (a
        Ctrl-C), it leaves nothing behind. ``add_kwargs`` go to the engine's ``add_request`` (``keep_logits``)."""
        self._check_room(self.num_waiting, len(requests))
        self.compile_grammars(params)
        queues: list[queue.SimpleQueue[Delivery]] = [queue.SimpleQueue() for _ in requests]
        try:
            self.call_sync(self._adder(requests, params, [Sink(q.put, stream) for q in queues], add_kwargs))
        except Exception:
            raise  # the add itself failed and took its requests back
        except BaseException:
            for request_id, _ in requests:
                self.abort(request_id)
            raise
        return queues

    async def stream(
        self, request_id: str, outputs: asyncio.Queue[Delivery], deadline: float | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield an added request's cumulative outputs as the engine produces them; leaving early aborts it.
        Past ``deadline`` (a ``time.monotonic()`` value) it aborts the request and raises TimeoutError."""
        finished = False
        try:
            while not finished:
                if deadline is None:
                    item = await outputs.get()
                else:
                    try:
                        item = await asyncio.wait_for(outputs.get(), max(0.0, deadline - time.monotonic()))
                    except asyncio.TimeoutError:
                        raise TimeoutError(f"request {request_id} ran past its deadline") from None
                item = _checked(item)
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def stream_sync(
        self, request_id: str, outputs: queue.SimpleQueue[Delivery], deadline: float | None = None
    ) -> Iterator[RequestOutput]:
        """``stream`` for a plain thread."""
        finished = False
        try:
            while not finished:
                try:
                    timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                    item = _checked(outputs.get(timeout=timeout))
                except queue.Empty:
                    raise TimeoutError(f"request {request_id} ran past its deadline") from None
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Drop the request and free its blocks before the next step (a client went away); returns at once."""
        with contextlib.suppress(EngineDeadError):  # a stopped loop has aborted everything already
            self._submit(lambda _: self._abort_now(request_id), None)

    async def stats(self) -> dict[str, Any]:
        if self.thread.is_alive() and (self.closed or self.error is not None or self.stopped):
            await asyncio.to_thread(self.thread.join, 10)  # it is aborting its requests: let it finish first
        if not self.thread.is_alive():  # the thread is gone: reading the engine directly is safe
            return self.engine.stats()
        return await self.call(lambda engine: engine.stats())

    def shutdown(self, wait: bool = True) -> None:
        """Stop after the current step: waiting requests and calls get EngineDeadError, requests are aborted, and
        grammar compiles in progress are killed. ``wait``: until the loop thread has ended (a step is short; ten
        seconds at most)."""
        if self.grammars is not None:
            self.grammars.close()
        self.stopped = True
        self.wake.set()
        if wait and threading.current_thread() is not self.thread:
            self.thread.join(timeout=10)

    def _check_room(self, waiting: int, adding: int) -> None:
        if self.max_waiting_requests and waiting + adding > self.max_waiting_requests:
            raise QueueFullError(
                f"{waiting} requests are waiting and {adding} more would exceed max_waiting_requests="
                f"{self.max_waiting_requests}"
            )

    # ------------------------------------------------------------------ loop thread
    def _abort_now(self, request_id: str) -> None:
        self.sinks.pop(request_id, None)
        self.engine.abort_request(request_id)  # an unknown or finished id is ignored
        if self.on_abort is not None:
            self.on_abort(request_id)

    def _adds_waiting(self) -> bool:
        return self.adds_queued > self.adds_run

    def _run_calls(self) -> None:
        while True:
            try:
                fn, settle = self.calls.get_nowait()
            except queue.Empty:
                self.num_waiting = len(self.engine.scheduler.waiting)
                return
            try:
                result, error = fn(self.engine), None
            except Exception as exc:  # noqa: BLE001 - goes back to the caller
                result, error = None, exc
            if settle is not None:
                with contextlib.suppress(RuntimeError):  # the caller's event loop has closed
                    settle(result, error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if self.on_output is not None:
                try:
                    self.on_output(out)
                except Exception:  # noqa: BLE001 - an observer (metrics) must not stop the engine
                    logger.exception("the on_output callback failed for request %s", out.request_id)
            sink = self.sinks.get(out.request_id)
            if sink is None or not (out.finished or sink.every_step):
                continue
            try:
                sink.put(out)
            except RuntimeError:  # its caller's event loop has closed: nobody will read this request
                self._abort_now(out.request_id)
                continue
            if out.finished:
                del self.sinks[out.request_id]

    def _fail_requests(self, failure: StepError) -> None:
        """The engine already aborted the failed step's requests: tell their callers why."""
        for request_id in failure.request_ids:
            sink = self.sinks.pop(request_id, None)
            if sink is not None:
                with contextlib.suppress(RuntimeError):  # a closed event loop has no reader left
                    sink.put(RequestFailedError(f"request {request_id} failed: {failure.__cause__!r}"))
            if self.on_abort is not None:
                self.on_abort(request_id)

    def _step(self) -> list[RequestOutput]:
        """Per-step outputs only when someone streams or watches them (building them costs host time)."""
        every_step = self.on_output is not None or any(s.every_step for s in self.sinks.values())
        return self.engine.step(finished_only=not every_step)

    def _run(self) -> None:
        error: BaseException | None = None
        while not self.stopped:
            self.wake.wait()
            self.wake.clear()  # before running the calls: one queued after this sets it again
            try:
                self._run_calls()
                while self.engine.has_unfinished_requests() and not self.stopped:
                    try:
                        self._deliver(self._step())
                    except StepError as failure:
                        self._fail_requests(failure)
                    self._run_calls()
            except BaseException as exc:  # noqa: BLE001 - reported to every waiting request and /health
                logger.exception("engine step failed; the engine loop stops")
                self.error = error = exc
                break
        with self.submit_lock:  # from here on nothing can be queued
            self.closed = True
        if self.engine.arrivals == self._adds_waiting:  # not a later loop's, on the same engine
            self.engine.arrivals = None
        reason = error or EngineDeadError("the engine loop was shut down")
        for request_id, sink in list(self.sinks.items()):
            with contextlib.suppress(RuntimeError):  # a closed event loop has no reader left
                sink.put(reason)
            with contextlib.suppress(Exception):
                self._abort_now(request_id)
        self.sinks.clear()
        self._fail_calls(reason)

    def _fail_calls(self, exc: BaseException) -> None:
        """Calls queued before the loop closed get its error instead of waiting forever."""
        while True:
            try:
                _, settle = self.calls.get_nowait()
            except queue.Empty:
                return
            if settle is not None:
                with contextlib.suppress(RuntimeError):
                    settle(None, EngineDeadError(f"the engine stopped: {exc!r}"))


def _checked(item: Delivery) -> RequestOutput:
    if isinstance(item, RequestFailedError):
        raise item
    if isinstance(item, BaseException):
        raise EngineDeadError(f"the engine stopped: {item!r}") from item
    return item


def _structured(params: SamplingParams | list[SamplingParams]) -> list[StructuredOutputsParams]:
    """The output formats the requests ask for."""
    formats = (p.structured_outputs for p in (params if isinstance(params, list) else [params]))
    return [f for f in formats if f is not None]
