"""Data-parallel replicas behind the engine loop's interface (``add``, ``stream``, ``abort``, ``stats``,
``alive``, ``shutdown``), so the OpenAI server runs on N replicas as it runs on one engine.

``add`` routes each request (``distributed/router.py``) and queues it on its replica, all or none. ``stream``
relays the replica's outputs. When a replica's process dies under a request, what happens depends on what its
client has seen: a request added with ``stream=False`` (its client waits for the whole response) or a stream that
has delivered nothing yet is queued again on another replica, from the start; a stream that has delivered output
ends with ``RequestFailedError`` (an error event and ``[DONE]`` on the server). Either way the replica is taken
out of routing until it answers again (``replicas.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from paged_backend.distributed.router import Router
from paged_backend.engine.engine_loop import EngineDeadError, RequestFailedError
from paged_backend.entrypoints.data_parallel.replica import NotOnReplica
from paged_backend.entrypoints.data_parallel.replicas import Replica, Replicas, summed_stats
from paged_backend.outputs import RequestOutput
from paged_backend.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ray import ObjectRefGenerator

    from paged_backend.structured_output.grammar_budget import GrammarService

logger = logging.getLogger(__name__)


@dataclass
class Ticket:
    """An added request: the replica it runs on, and what it takes to queue it again on another."""

    request_id: str
    prompt: Any
    params: SamplingParams
    add_kwargs: dict[str, Any]
    stream: bool  # False: its caller reads only the final output, so a retry is invisible to it
    token_ids: list[int]
    salt: int  # separates caches that share no blocks (a LoRA adapter's id)
    replica: int
    arrival: float = field(default_factory=time.monotonic)
    generator: ObjectRefGenerator[RequestOutput] | None = None


class ReplicaSet:
    """N replicas (``replica.EngineReplica`` actors) and the router that spreads requests over them."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        router: Router,
        probe_interval_s: float = 0.5,
        probe_timeout_s: float = 10.0,
    ) -> None:
        self.router = router
        self.router_lock = threading.Lock()  # the router's tables: callers on any thread, the watcher
        self.replicas = Replicas(replicas, self._forget, probe_interval_s, probe_timeout_s)
        self.tickets: dict[str, Ticket] = {}
        self.on_output: Callable[[RequestOutput], None] | None = None  # sees each output (the server's metrics)
        self.on_abort: Callable[[str], None] | None = None
        self.grammars: GrammarService | None = None  # each replica caps and compiles its own requests' grammars
        self.closed = False
        self.num_retries = 0  # requests queued again after their replica died
        self.num_resumed = 0  # of which: requests that were already running there (not just being queued)

    @property
    def alive(self) -> bool:
        return not self.closed and bool(self.replicas.running())

    # ------------------------------------------------------------------ routing
    def _forget(self, index: int) -> None:
        with self.router_lock:
            self.router.forget(index)

    def _route(self, ticket: Ticket, exclude: set[int]) -> int:
        running = [i for i in self.replicas.running() if i not in exclude]
        if self.closed or not running:
            raise EngineDeadError("no data-parallel replica is running")
        loads = Counter(t.replica for t in list(self.tickets.values()))  # a copy: other threads add and remove
        with self.router_lock:
            return self.router.choose(ticket.token_ids, {i: loads[i] for i in running}, ticket.salt)

    # ------------------------------------------------------------------ requests
    async def add(
        self,
        requests: list[tuple[str, Any]],
        params: SamplingParams | list[SamplingParams],
        stream: bool = True,
        **add_kwargs: Any,
    ) -> list[Ticket]:
        """Route and queue the requests, all or none: a replica's error for a bad one (ValueError, QueueFullError,
        ...) is raised here as it was raised there; EngineDeadError when no replica runs."""
        per_params = params if isinstance(params, list) else [params] * len(requests)
        tickets: list[Ticket] = []
        try:  # routing fails, a replica refuses, or the caller is cancelled (its client left): none stays queued
            for i, ((request_id, prompt), p) in enumerate(zip(requests, per_params)):
                kwargs = {key: value[i] if isinstance(value, list) else value for key, value in add_kwargs.items()}
                lora = kwargs.get("lora_request")
                ids = list(prompt.get("prompt_token_ids") or ()) if isinstance(prompt, dict) else []
                ticket = Ticket(request_id, prompt, p, kwargs, stream, ids, getattr(lora, "lora_int_id", 0), -1)
                ticket.replica = self._route(ticket, set())
                self.tickets[request_id] = ticket  # counted in the next request's loads
                tickets.append(ticket)
            groups: dict[int, list[Ticket]] = {}
            for ticket in tickets:
                groups.setdefault(ticket.replica, []).append(ticket)
            queued = (self._queue(group) for group in groups.values())
            results = await asyncio.gather(*queued, return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
        except BaseException:
            for ticket in tickets:
                self.abort(ticket.request_id)
            raise
        return tickets

    async def _queue(self, tickets: list[Ticket]) -> None:
        """Queue tickets that share a replica there, in one call; a replica found dead sends them to another."""
        from ray.exceptions import RayActorError, RayTaskError

        tried: set[int] = set()
        while True:
            replica = self.replicas.items[tickets[0].replica]
            requests = [(t.request_id, t.prompt) for t in tickets]
            keys = {key for t in tickets for key in t.add_kwargs}
            kwargs = {key: [t.add_kwargs.get(key) for t in tickets] for key in keys}
            # Each step's outputs cross only for a caller that reads them (a stream, the server's metrics).
            every_step = self.on_output is not None or any(t.stream for t in tickets)
            try:
                await replica.actor.add.remote(requests, [t.params for t in tickets], every_step, **kwargs)
                return
            except RayTaskError as exc:
                raise cause_of(exc) from None
            except RayActorError as exc:
                self.replicas.lost(replica.index, exc)
                forget_on(replica.actor, [t.request_id for t in tickets])
                tried.add(replica.index)
                self.num_retries += len(tickets)
                for ticket in tickets:
                    ticket.replica = self._route(ticket, tried)

    async def stream(
        self, request_id: str, ticket: Ticket, deadline: float | None = None
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs (only its final one for ``stream=False``); leaving early aborts it. Past
        ``deadline`` (a ``time.monotonic()`` value) it is aborted and TimeoutError raised."""
        from ray.exceptions import RayActorError, RayTaskError

        delivered = finished = False
        tried: set[int] = set()
        try:
            while not finished:
                replica = self.replicas.items[ticket.replica]
                ticket.generator = replica.actor.stream.options(num_returns="streaming").remote(request_id)
                try:
                    async for out in _outputs(ticket.generator, request_id, deadline):
                        out.metrics["arrival_time"] = ticket.arrival  # this process's clock, as the metrics read
                        if self.on_output is not None:
                            self.on_output(out)
                        finished = out.finished
                        if ticket.stream or finished:
                            delivered = True
                            yield out
                        if finished:  # nothing follows the final output, not even a replica's later death
                            break
                    if not finished:
                        raise RequestFailedError(f"request {request_id} ended without a final output")
                except RayTaskError as exc:
                    cause = cause_of(exc)
                    if not isinstance(cause, NotOnReplica) or delivered or request_id not in self.tickets:
                        raise cause from None
                    if replica.index in tried:  # queued there again and gone again: not a restart
                        raise cause from None
                    tried.add(replica.index)  # restarted since the add: the request runs again, there or elsewhere
                    self.num_retries += 1
                    await self._queue([ticket])
                    self.num_resumed += 1
                except RayActorError as exc:
                    self.replicas.lost(replica.index, exc)
                    if delivered:
                        raise RequestFailedError(
                            f"request {request_id} failed: data-parallel replica {replica.index} died mid-stream"
                        ) from exc
                    forget_on(replica.actor, [request_id])
                    tried.add(replica.index)
                    ticket.replica = self._route(ticket, tried)
                    self.num_retries += 1
                    logger.warning("request %s: replica %d died; queued again on replica %d", request_id,
                                   replica.index, ticket.replica)  # fmt: skip
                    await self._queue([ticket])
                    self.num_resumed += 1
        finally:
            if not finished:
                self.abort(request_id)
            self.tickets.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Drop the request on its replica (its blocks are freed there); returns at once."""
        ticket = self.tickets.pop(request_id, None)
        if ticket is None:
            return
        if self.on_abort is not None:
            self.on_abort(request_id)
        if ticket.replica < 0:
            return
        import ray

        with contextlib.suppress(Exception):  # a dead replica has nothing left to free
            if ticket.generator is not None:
                ray.cancel(ticket.generator)
            self.replicas.items[ticket.replica].actor.abort.remote(request_id)

    async def stats(self) -> dict[str, Any]:
        """One engine's ``stats()`` over the running replicas, and each replica's state (``replicas``)."""
        running = self.replicas.running()
        answers = await asyncio.gather(
            *(self.replicas.items[i].actor.stats.remote() for i in running), return_exceptions=True
        )
        states = self.replicas.describe()
        per_replica: list[dict[str, Any]] = []
        for i, answer in zip(running, answers):
            if isinstance(answer, dict):
                states[i]["stats"] = answer
                per_replica.append(answer)
        total = summed_stats(per_replica, states)
        total["num_request_retries"] = self.num_retries
        return total

    def shutdown(self, wait: bool = True) -> None:
        """Abort every request and stop the replicas' watcher (the replicas themselves belong to their owner);
        ``wait=False`` (from the event loop) does not wait for the watcher's probe in flight to end."""
        self.closed = True
        for request_id in list(self.tickets):
            self.abort(request_id)
        self.replicas.close(wait)


def forget_on(actor: Any, request_ids: list[str]) -> None:
    """Before a request runs again elsewhere: abort it on the replica that failed a call, in case that replica is
    only unreachable for a while (Ray's ActorUnavailableError) and did take it; a dead one has nothing to free."""
    for request_id in request_ids:
        with contextlib.suppress(Exception):
            actor.abort.remote(request_id)


async def _outputs(
    generator: ObjectRefGenerator[RequestOutput], request_id: str, deadline: float | None
) -> AsyncIterator[RequestOutput]:
    """A replica's streamed outputs, each awaited from its object ref."""
    while True:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            ref = await asyncio.wait_for(generator.__anext__(), timeout)
            out: RequestOutput = await asyncio.wait_for(ref, timeout)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise TimeoutError(f"request {request_id} ran past its deadline") from None
        yield out


def cause_of(exc: BaseException) -> BaseException:
    """The replica's own exception inside Ray's wrapper (a ValueError stays a ValueError for the server)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc
