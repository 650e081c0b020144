"""One data-parallel replica: an ``LLM`` and its engine loop in a process of its own, run as a Ray actor.

The actor is asynchronous: its methods run on the actor's event loop while the engine steps on the engine loop's
thread, so a ``ping`` or an ``abort`` answers in the middle of a long step. ``add`` queues a batch of requests
(a bad one fails them all, before any output, as on one engine); ``stream`` then yields one request's outputs as
the engine makes them, through Ray's streaming generators. Ray restarts the actor after its process dies
(``max_restarts``): ``__init__`` runs again and the replica rejoins with an empty cache.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paged_backend.outputs import RequestOutput
from paged_backend.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from paged_backend.engine.engine_loop import Delivery
    from paged_backend.structured_output.grammar_budget import GrammarBudget

logger = logging.getLogger(__name__)


class NotOnReplica(KeyError):
    """A stream asked of a replica that does not hold the request: it was aborted, or the replica restarted
    (a new process, its requests gone) between the request's add and its stream."""


@dataclass(frozen=True)
class ReplicaFacts:
    """What the front end needs to know of a replica's engine (every replica runs the same one)."""

    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    block_size: int
    num_kv_blocks: int
    lora_enabled: bool
    pid: int  # the replica's process (a test kills it)
    node_id: str  # the Ray node it runs on


class EngineReplica:
    """The actor's body (``ray.remote`` wraps it when the replicas start, so that Ray loads only then)."""

    def __init__(
        self,
        model: str,
        engine_kwargs: dict[str, Any],
        max_waiting_requests: int | None = None,
        grammar_budget: GrammarBudget | None = None,
    ) -> None:
        from paged_backend.engine.fresh_thread import call_in_fresh_thread
        from paged_backend.entrypoints.llm import LLM

        self.queues: dict[str, asyncio.Queue[Delivery]] = {}
        try:
            # Built on a thread that then ends, so the engine loop's thread holds the process's only OpenMP team.
            self.llm = call_in_fresh_thread(lambda: LLM(model, **engine_kwargs))
        except Exception as exc:  # noqa: BLE001 - raised by ``facts``: the front end's caller sees the ValueError
            self.failure: Exception | None = exc
            return
        self.failure = None
        self.loop = self.llm.start_engine_loop(max_waiting_requests=max_waiting_requests)
        if grammar_budget is not None:
            from paged_backend.structured_output.grammar_budget import GrammarService

            engine = self.llm.llm_engine
            self.loop.grammars = GrammarService(grammar_budget, engine.input_processor.grammar_compiler)

    async def facts(self) -> ReplicaFacts:
        """The engine's limits; raises the error that kept the engine from starting (a bad engine argument)."""
        import ray

        if self.failure is not None:
            raise self.failure

        engine = self.llm.llm_engine
        stats = engine.stats()
        return ReplicaFacts(
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            max_num_seqs=engine.config.scheduler_config.max_num_seqs,
            block_size=stats["block_size"],
            num_kv_blocks=stats["num_kv_blocks"],
            lora_enabled=engine.lora_manager is not None,
            pid=os.getpid(),
            node_id=ray.get_runtime_context().get_node_id(),
        )

    async def tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self.llm.get_tokenizer()

    async def ping(self) -> int:
        """Alive and serving: the process id (it changes when Ray restarted the replica)."""
        if self.failure is not None or not self.loop.alive:
            raise RuntimeError("the replica's engine is not running")
        return os.getpid()

    async def check_lora(self, lora: Any) -> None:
        """Load an adapter now (a bad one raises), so that a server stops at start-up rather than at a request."""
        manager = self.llm.llm_engine.lora_manager
        if manager is None:
            raise ValueError("--lora-modules needs --enable-lora")
        manager.get(lora)

    async def add(
        self,
        requests: list[tuple[str, Any]],
        params: SamplingParams | list[SamplingParams],
        every_step: bool = True,
        **add_kwargs: Any,
    ) -> None:
        """Queue the requests on the engine, all or none (the engine loop's ``add``, with its errors).
        ``every_step=False``: only their final outputs cross to the front end."""
        queues = await self.loop.add(requests, params, stream=every_step, **add_kwargs)
        self.queues.update((request_id, q) for (request_id, _), q in zip(requests, queues))

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """An added request's outputs as they come; the caller cancelling this (or leaving) aborts the request."""
        outputs = self.queues.pop(request_id, None)
        if outputs is None:
            raise NotOnReplica(f"request {request_id} was not added to this replica, or was aborted")
        async for out in self.loop.stream(request_id, outputs):
            yield out

    async def abort(self, request_id: str) -> None:
        self.queues.pop(request_id, None)
        self.loop.abort(request_id)

    async def stats(self) -> dict[str, Any]:
        return await self.loop.stats()

    async def reset_prefix_cache(self) -> None:
        await self.loop.call(lambda engine: engine.scheduler.reset_prefix_cache())

    async def shutdown(self) -> None:
        self.llm.shutdown()
