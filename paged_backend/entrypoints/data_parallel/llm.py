"""``DataParallelLLM``: N engine replicas on Ray behind one router, from Python (the server's
``--data-parallel-size N`` runs the same object).

    from paged_backend.entrypoints.data_parallel import DataParallelLLM

    with DataParallelLLM("path", data_parallel_size=2, block_size=16) as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=64))
        print(llm.stats()["prefix_cache_hit_rate"])

Each replica is a Ray actor holding an ``LLM`` (``replica.py``), so replicas run on whichever nodes of the Ray
cluster have room (``ray start --head`` / ``ray start --address=HEAD:6379``; a local instance is started when none
runs), each with its own KV cache and, with ``tensor_parallel_size`` > 1, its own workers. Ray restarts a replica
whose process dies (``max_restarts``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from paged_backend.distributed.router import RouterConfig, make_router
from paged_backend.entrypoints.data_parallel.config import DataParallelConfig
from paged_backend.entrypoints.data_parallel.replica import EngineReplica, ReplicaFacts
from paged_backend.entrypoints.data_parallel.replica_set import ReplicaSet, cause_of
from paged_backend.entrypoints.data_parallel.replicas import Replica
from paged_backend.outputs import RequestOutput
from paged_backend.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from transformers import PreTrainedTokenizerBase

    from paged_backend.lora.request import LoRARequest
    from paged_backend.structured_output.grammar_budget import GrammarBudget

logger = logging.getLogger(__name__)


class DataParallelLLM:
    """``data_parallel_size`` replicas of ``LLM(model, **engine_kwargs)``; ``routing``: ``"prefix"`` (prefix-cache
    affinity under a load bound) or ``"round_robin"``. ``config`` gives every data-parallel option at once."""

    def __init__(
        self,
        model: str,
        data_parallel_size: int = 2,
        routing: str = "prefix",
        config: DataParallelConfig | None = None,
        max_waiting_requests: int | None = None,
        grammar_budget: GrammarBudget | None = None,
        **engine_kwargs: Any,
    ) -> None:
        if not isinstance(model, str):
            raise TypeError(f"model must be a path or hub id (each replica loads it), got {type(model).__name__}")
        if config is None:
            config = DataParallelConfig(data_parallel_size, RouterConfig(policy=routing))
        self.config = config
        self.actors = _start_replicas(model, engine_kwargs, config, max_waiting_requests, grammar_budget)
        import ray

        try:
            facts = cast(list[ReplicaFacts], ray.get([actor.facts.remote() for actor in self.actors]))
        except ray.exceptions.RayTaskError as exc:  # a replica's engine did not start: its own error, once
            for actor in self.actors:
                ray.kill(actor, no_restart=True)
            raise cause_of(exc) from None
        self.facts = facts[0]
        self.tokenizer = cast("PreTrainedTokenizerBase | None", ray.get(self.actors[0].tokenizer.remote()))
        router_config = dataclasses.replace(config.router, block_size=self.facts.block_size)
        replicas = [Replica(i, a, f.pid, f.node_id) for i, (a, f) in enumerate(zip(self.actors, facts))]
        self.replica_set: ReplicaSet = ReplicaSet(
            replicas,
            make_router(router_config, self.facts.num_kv_blocks),
            config.probe_interval_s,
            config.probe_timeout_s,
        )
        self._loop: asyncio.AbstractEventLoop | None = None  # the synchronous calls' event loop, on first use
        self._loop_lock: threading.Lock = threading.Lock()
        self._counter: int = 0
        logger.info(
            "data parallelism: %d replicas (%s routing) on nodes %s",
            len(facts),
            router_config.policy,
            sorted({f.node_id[:8] for f in facts}),
        )

    # ------------------------------------------------------------------ the server's view
    def get_tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self.tokenizer

    def check_lora(self, lora: Any) -> None:
        import ray

        ray.get(self.actors[0].check_lora.remote(lora))

    # ------------------------------------------------------------------ synchronous API
    def generate(
        self,
        prompts: str | Sequence[Any],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """``LLM.generate`` over the replicas: each prompt routed on its own, the outputs in the prompts' order."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        return self._run(self.generate_async(prompts, params, lora_request))

    async def generate_async(
        self,
        prompts: list[Any],
        params: SamplingParams | list[SamplingParams],
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        requests = [(self._next_id(), self._routable(p)) for p in prompts]
        tickets = await self.replica_set.add(requests, params, stream=False, lora_request=lora_request)
        streams = [self._final(rid, t) for (rid, _), t in zip(requests, tickets)]
        return list(await asyncio.gather(*streams))

    def stats(self) -> dict[str, Any]:
        """The replicas' ``stats()`` summed as one engine's (``prefix_cache_hit_rate`` over every replica's prompt
        tokens), with each replica's state and own stats under ``replicas``."""
        return self._run(self.replica_set.stats())

    def reset_prefix_cache(self) -> None:
        import ray

        ray.get([actor.reset_prefix_cache.remote() for actor in self.actors])

    def shutdown(self) -> None:
        """Stop routing and the replicas (their engines and workers); a second call does nothing."""
        import ray

        if self.replica_set.closed:
            return
        self.replica_set.shutdown()
        for actor in self.actors:
            try:
                ray.get(actor.shutdown.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - a replica that is gone or hangs is killed below
                logger.debug("replica shutdown failed", exc_info=True)
            ray.kill(actor, no_restart=True)
        with self._loop_lock:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._loop = None

    def __enter__(self) -> DataParallelLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ helpers
    def _next_id(self) -> str:
        self._counter += 1
        return f"dp-{self._counter}"

    def _routable(self, prompt: Any) -> Any:
        """A text prompt with its token ids beside it (the router hashes them); the replica tokenizes the text
        the same way."""
        if isinstance(prompt, str) and self.tokenizer is not None:
            return {"prompt": prompt, "prompt_token_ids": list(self.tokenizer(prompt).input_ids)}
        return prompt

    async def _final(self, request_id: str, ticket: Any) -> RequestOutput:
        final: RequestOutput | None = None
        async for out in self.replica_set.stream(request_id, ticket):
            final = out
        assert final is not None and final.finished
        return final

    def _run(self, coroutine: Any) -> Any:
        with self._loop_lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="paged-backend-dp", daemon=True).start()
            loop = self._loop
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result()


def _start_replicas(
    model: str,
    engine_kwargs: dict[str, Any],
    config: DataParallelConfig,
    max_waiting_requests: int | None,
    grammar_budget: GrammarBudget | None,
) -> list[ActorHandle[EngineReplica]]:
    """The replicas as Ray actors, on the running cluster (or a local instance started here)."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError("data_parallel_size > 1 needs Ray: pip install 'paged-backend[ray]'") from exc
    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True, include_dashboard=False)
    num_gpus = config.num_gpus_per_replica
    if num_gpus is None:
        on_gpu = str(engine_kwargs.get("device", "auto")).startswith(("cuda", "auto")) and _cluster_has_gpus()
        num_gpus = float(engine_kwargs.get("tensor_parallel_size", 1)) if on_gpu else 0.0
    actor_class = ray.remote(EngineReplica).options(
        max_restarts=config.max_restarts,
        max_task_retries=0,  # a request is queued again by the front end, which knows what its client saw
        num_cpus=config.num_cpus_per_replica,
        num_gpus=num_gpus,
    )
    args = (model, engine_kwargs, max_waiting_requests, grammar_budget)
    return [cast("ActorHandle[EngineReplica]", actor_class.remote(*args)) for _ in range(config.data_parallel_size)]


def _cluster_has_gpus() -> bool:
    import ray

    return bool(ray.cluster_resources().get("GPU", 0))
